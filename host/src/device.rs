//! The device handle: CUDA context, device limits, and the lazily JIT-compiled kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute as A;
use cudarc::driver::sys::CUfunction_attribute as F;
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use crate::error::{Context as _, Error, Result};

/// Whether a CUDA driver library can be loaded on this machine (no GPU work is attempted
/// without one; `CudaContext::new` would panic).
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library; it has no
    // preconditions and touches no state of ours.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// What the kernels and the tuner need to know about the device.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceInfo {
    pub name: String,
    pub cc: (i32, i32),
    pub sm_count: u32,
    /// Dynamic shared memory a block may opt into.
    pub max_smem_optin: u32,
    pub driver_version: i32,
}

impl DeviceInfo {
    /// One cache file per device kind: name, SM version, driver.
    pub fn fingerprint(&self) -> String {
        let clean: String = self.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
        format!("{clean}-sm{}{}-drv{}", self.cc.0, self.cc.1, self.driver_version)
    }
}

/// A GPU with the kernels: one per CUDA context.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("info", &self.info).finish()
    }
}

impl Gpu {
    /// Open device `ordinal` (its primary context). Fails with [`Error::NoDriver`] on a machine
    /// without the driver and [`Error::UnsupportedDevice`] on anything but compute capability 9.0.
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        if !driver_present() {
            return Err(Error::NoDriver);
        }
        let ctx = CudaContext::new(ordinal).during(|| format!("opening device {ordinal}"))?;
        Self::from_context(ctx)
    }

    /// Use an existing context (for example the one a training framework created).
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Arc<Self>> {
        let name = ctx.name().during(|| "reading the device name".into())?;
        let cc = ctx.compute_capability().during(|| "reading the compute capability".into())?;
        if cc != (9, 0) {
            return Err(Error::UnsupportedDevice { name, cc });
        }
        let attr = |a| ctx.attribute(a).during(|| format!("reading device attribute {a:?}"));
        let sm_count = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_smem_optin = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        let mut driver_version = 0i32;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }.result().during(|| "reading the driver version".into())?;
        Ok(Arc::new(Self {
            ctx,
            info: DeviceInfo { name, cc, sm_count, max_smem_optin, driver_version },
            functions: Mutex::new(HashMap::new()),
        }))
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The kernel `name`, JIT-compiled from its own small PTX module on first use, with its
    /// dynamic shared-memory limit raised to `smem` bytes.
    pub fn function(&self, name: &str, smem: u32) -> Result<CudaFunction> {
        let mut fns = self.functions.lock().unwrap();
        if let Some(f) = fns.get(name) {
            return Ok(f.clone());
        }
        let src =
            crate::ptx::entry_modules().get(name).ok_or_else(|| Error::Config(format!("kernel `{name}` is not in the embedded PTX")))?;
        if smem > self.info.max_smem_optin {
            return Err(Error::Config(format!(
                "`{name}` needs {smem} bytes of shared memory, the device allows {}",
                self.info.max_smem_optin
            )));
        }
        let module = self.ctx.load_module(Ptx::from_src(src.clone())).during(|| format!("loading (JIT) kernel `{name}`"))?;
        let f = module.load_function(name).during(|| format!("finding kernel `{name}`"))?;
        f.set_attribute(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .during(|| format!("raising the shared-memory limit of `{name}` to {smem}"))?;
        fns.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Registers per thread of a loaded kernel (as the driver's JIT allocated them).
    pub fn registers(&self, name: &str, smem: u32) -> Result<u32> {
        let f = self.function(name, smem)?;
        Ok(f.num_regs().during(|| format!("reading the registers of `{name}`"))? as u32)
    }

    /// Kernels loaded so far.
    pub fn loaded(&self) -> Vec<String> {
        let mut v: Vec<String> = self.functions.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }
}
