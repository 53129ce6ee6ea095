//! The device handle: CUDA context, device limits, and the lazily JIT-compiled kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute as A;
use cudarc::driver::sys::CUfunction_attribute as F;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use lmhead_core::config::{kernel_name, Family, Module, TileConfig};

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
    /// L2 cache size in bytes (the forward's split plan keeps resident rows of `h` within a
    /// share of it).
    #[serde(default)]
    pub l2_bytes: u64,
    /// The kernel module this device loads ([`Module::for_device`]; the portable one on an
    /// sm_90 device only when a test forces it, `LMHEAD_TEST_MODULE`).
    #[serde(default)]
    pub module: Module,
}

impl DeviceInfo {
    /// One cache file per device kind: name, SM version, driver.
    pub fn fingerprint(&self) -> String {
        let clean: String = self.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
        let module = if self.module == Module::Portable { "-portable" } else { "" };
        format!("{clean}-sm{}{}-drv{}{module}", self.cc.0, self.cc.1, self.driver_version)
    }
}

/// A GPU with the kernels: one per CUDA context.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
    /// Loaded kernels and the dynamic shared memory each is currently allowed.
    functions: Mutex<HashMap<String, (CudaFunction, u32)>>,
    /// The embedded cubin, loaded on first use (`None` inside: not embedded or failed to load,
    /// with the reason in `cubin_note`).
    cubin: Mutex<Option<Option<Arc<CudaModule>>>>,
    cubin_note: Mutex<Option<String>>,
    /// Kernels that failed to load, with the reason; and the families already warned about.
    failed: Mutex<(HashMap<String, String>, Vec<Family>)>,
}

/// Where the kernels come from and how many of them load: what
/// [`LmHead::kernel_report`](crate::LmHead::kernel_report) answers, and what the demo and bench
/// headers print.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelReport {
    /// The module loaded: `Hopper` (sm_90a, both mainloops) or `Portable` (sm_80, `mma.sync`).
    pub module: Module,
    /// The path the kernels run: "wgmma+TMA" (the Hopper module: its rules pick the `Sm90`
    /// kernels, `mma.sync` where no Hopper kernel loads) or "mma.sync", then "sm_90a cubin",
    /// "sm_80 cubin" or "JIT of the sm_80 PTX for sm_XY".
    pub path: String,
    /// True when the kernels are the module's embedded cubin (no JIT).
    pub cubin: bool,
    /// "cubin (…)" or why the kernels are JIT-compiled from PTX.
    pub source: String,
    /// Per tuned family: (family, candidates, loaded).
    pub families: Vec<(Family, usize, usize)>,
    /// Fixed kernels (merges, label check, casts, units): (count, loaded).
    pub fixed: (usize, usize),
    /// Every kernel that failed to load, with the reason.
    pub failed: Vec<(String, String)>,
}

impl std::fmt::Display for KernelReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kernels: {} module, {}; {}; ", self.module.name(), self.path, self.source)?;
        let fams: Vec<String> = self.families.iter().map(|(fam, n, ok)| format!("{} {ok}/{n}", fam.stem())).collect();
        write!(f, "loaded {}, fixed {}/{}", fams.join(", "), self.fixed.1, self.fixed.0)?;
        write!(f, "; {} failed to load", self.failed.len())
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("info", &self.info).finish()
    }
}

impl Gpu {
    /// Open device `ordinal` (its primary context). Fails with [`Error::NoDriver`] on a machine
    /// without the driver and [`Error::UnsupportedDevice`] below compute capability 8.0.
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
        let Some(module) = Module::for_device(cc) else {
            return Err(Error::UnsupportedDevice { name, cc });
        };
        let module = test_module(cc).unwrap_or(Ok(module))?;
        let attr = |a| ctx.attribute(a).during(|| format!("reading device attribute {a:?}"));
        let sm_count = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_smem_optin = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        let l2_bytes = attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as u64;
        let mut driver_version = 0i32;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }.result().during(|| "reading the driver version".into())?;
        Ok(Arc::new(Self {
            ctx,
            info: DeviceInfo { name, cc, sm_count, max_smem_optin, driver_version, l2_bytes, module },
            functions: Mutex::new(HashMap::new()),
            cubin: Mutex::new(None),
            cubin_note: Mutex::new(None),
            failed: Mutex::new((HashMap::new(), Vec::new())),
        }))
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The kernel module this device loads.
    pub fn module(&self) -> Module {
        self.info.module
    }

    /// Whether the module's cubin is machine code for this device: sm_90a only on 9.0, sm_80
    /// within major 8; elsewhere the driver JIT-compiles the module's PTX.
    fn cubin_runs_here(&self) -> bool {
        match self.info.module {
            Module::Hopper => self.info.cc == (9, 0),
            Module::Portable => self.info.cc.0 == 8,
        }
    }

    /// The embedded cubin module (loaded once), if there is one and the driver accepts it.
    fn cubin_module(&self) -> Option<Arc<CudaModule>> {
        let mut slot = self.cubin.lock().unwrap();
        if let Some(m) = slot.as_ref() {
            return m.clone();
        }
        let module = self.info.module;
        let cubin = crate::ptx::cubin(module);
        let (major, minor) = self.info.cc;
        let m = if !self.cubin_runs_here() {
            *self.cubin_note.lock().unwrap() = Some(format!(
                "JIT of the {} PTX for sm_{major}{minor} (no cubin of the {} module runs on this architecture)",
                module.arch(),
                module.name()
            ));
            None
        } else if cubin.is_empty() {
            *self.cubin_note.lock().unwrap() = Some("no cubin embedded (built without ptxas): kernels are JIT-compiled".into());
            None
        } else if std::env::var("LMHEAD_FORCE_JIT").is_ok_and(|v| v == "1") {
            *self.cubin_note.lock().unwrap() = Some("LMHEAD_FORCE_JIT=1: kernels are JIT-compiled from PTX".into());
            None
        } else {
            match self.ctx.load_module(Ptx::from_binary(cubin.to_vec())) {
                Ok(m) => Some(m),
                Err(e) => {
                    let note = format!("the embedded cubin did not load ({e}); kernels are JIT-compiled from PTX");
                    eprintln!("lmhead: warning: {note}");
                    *self.cubin_note.lock().unwrap() = Some(note);
                    None
                }
            }
        };
        *slot = Some(m.clone());
        m
    }

    /// How kernels are loaded: from the embedded cubin, or why they are JIT-compiled.
    pub fn loader(&self) -> String {
        match self.cubin_module() {
            Some(_) => format!("cubin ({}, assembled at build time)", self.info.module.arch()),
            None => self.cubin_note.lock().unwrap().clone().unwrap_or_default(),
        }
    }

    /// The entry point of `cfg` in `family`, with its shared-memory limit raised to the config's.
    pub fn tuned_function(&self, family: Family, cfg: TileConfig) -> Result<CudaFunction> {
        self.function(&kernel_name(family, cfg), cfg.smem_bytes() as u32)
    }

    /// The kernel `name` with its dynamic shared-memory limit raised to `smem` bytes: from the
    /// embedded cubin when there is one, else JIT-compiled from its own small PTX module on first
    /// use (a JIT failure reports the driver's error log).
    pub fn function(&self, name: &str, smem: u32) -> Result<CudaFunction> {
        if smem > self.info.max_smem_optin {
            return Err(Error::Config(format!(
                "`{name}` needs {smem} bytes of shared memory, the device allows {}",
                self.info.max_smem_optin
            )));
        }
        let r = self.load_function(name, smem);
        if let Err(e) = &r {
            self.record_failure(name, e.to_string());
        }
        r
    }

    /// Remember a kernel that did not load; warn once when every candidate of its family failed
    /// (the tuner then has nothing of that family to choose from).
    fn record_failure(&self, name: &str, reason: String) {
        let mut g = self.failed.lock().unwrap();
        g.0.insert(name.to_string(), reason.clone());
        let Some(family) = Family::ALL.into_iter().find(|f| f.candidates().iter().any(|&c| kernel_name(*f, c) == name)) else { return };
        let all_failed = family.candidates().iter().all(|&c| g.0.contains_key(&kernel_name(family, c)));
        if all_failed && !g.1.contains(&family) {
            g.1.push(family);
            eprintln!(
                "lmhead: warning: no kernel of family {} loads on this device ({}); last error: {reason}",
                family.stem(),
                self.loader()
            );
        }
    }

    /// Load every kernel (tuned candidates and fixed kernels) and report where they came from and
    /// how many loaded. From the cubin this takes milliseconds; JIT-compiling all of them
    /// (`LMHEAD_FORCE_JIT=1` or a PTX-only build) takes much longer.
    pub fn kernel_report(&self) -> KernelReport {
        let mut families = Vec::new();
        for f in Family::ALL {
            // The candidates this module holds (the portable one has no `Sm90` kernels).
            let held: Vec<TileConfig> = f.candidates().iter().copied().filter(|c| self.info.module.holds(c.mainloop)).collect();
            let ok = held.iter().filter(|&&c| self.tuned_function(f, c).is_ok()).count();
            families.push((f, held.len(), ok));
        }
        let module = self.info.module;
        let fixed = module.fixed();
        let fixed_ok = fixed.iter().filter(|n| self.function(n, 0).is_ok()).count();
        let mut failed: Vec<(String, String)> = self.failed.lock().unwrap().0.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        failed.sort();
        let cubin = self.cubin_module().is_some();
        let mainloop = match module {
            Module::Hopper => "wgmma+TMA",
            Module::Portable => "mma.sync",
        };
        let (major, minor) = self.info.cc;
        let how =
            if cubin { format!("{} cubin", module.arch()) } else { format!("JIT of the {} PTX for sm_{major}{minor}", module.arch()) };
        KernelReport {
            module,
            path: format!("{mainloop}, {how}"),
            cubin,
            source: self.loader(),
            families,
            fixed: (fixed.len(), fixed_ok),
            failed,
        }
    }

    fn load_function(&self, name: &str, smem: u32) -> Result<CudaFunction> {
        // A kernel launched with more shared memory than at its first use (the unit kernels'
        // boxes vary) gets its limit raised; asking for less needs nothing.
        let raise = |f: &CudaFunction| {
            f.set_attribute(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .during(|| format!("raising the shared-memory limit of `{name}` to {smem}"))
        };
        let cached = |(f, limit): &mut (CudaFunction, u32)| -> Result<CudaFunction> {
            if smem > *limit {
                raise(f)?;
                *limit = smem;
            }
            Ok(f.clone())
        };
        if let Some(entry) = self.functions.lock().unwrap().get_mut(name) {
            return cached(entry);
        }
        let cubin = self.cubin_module();
        let mut fns = self.functions.lock().unwrap();
        if let Some(entry) = fns.get_mut(name) {
            return cached(entry);
        }
        let f = match cubin {
            Some(m) => m.load_function(name).during(|| format!("finding kernel `{name}` in the embedded cubin"))?,
            None => {
                let module = self.info.module;
                let src = crate::ptx::entry_modules_of(module)
                    .get(name)
                    .ok_or_else(|| Error::Config(format!("kernel `{name}` is not in the embedded PTX of the {} module", module.name())))?;
                let module = match self.ctx.load_module(Ptx::from_src(src.clone())) {
                    Ok(m) => m,
                    Err(e) => return Err(Error::Config(format!("JIT of kernel `{name}` failed ({e}): {}", jit_error_log(src)))),
                };
                module.load_function(name).during(|| format!("finding kernel `{name}`"))?
            }
        };
        raise(&f)?;
        fns.insert(name.to_string(), (f.clone(), smem));
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

/// The module a test asks for with `LMHEAD_TEST_MODULE=portable` (or `hopper`), read only in
/// builds with the `testing` feature (the tests and benches; never a user's build): the
/// portable module on the H200, JIT-compiled from its sm_80 PTX, runs the whole GPU suite on
/// the kernels the other architectures load. `None`: unset, the device's own module.
fn test_module(cc: (i32, i32)) -> Option<Result<Module>> {
    if !cfg!(feature = "testing") {
        return None;
    }
    let v = std::env::var("LMHEAD_TEST_MODULE").ok()?;
    Some(match v.trim() {
        "" => return None,
        "portable" => Ok(Module::Portable),
        "hopper" if cc == (9, 0) => Ok(Module::Hopper),
        other => Err(Error::Config(format!(
            "LMHEAD_TEST_MODULE={other}: expected `portable`, or `hopper` on a compute capability 9.0 device (this one is {}.{})",
            cc.0, cc.1
        ))),
    })
}

/// The driver JIT's error log for `ptx` (loads it once more with a log buffer; the module is
/// unloaded if it unexpectedly succeeds).
fn jit_error_log(ptx: &str) -> String {
    use cudarc::driver::sys;
    let Ok(src) = std::ffi::CString::new(ptx) else { return "PTX contains a NUL byte".into() };
    let mut log = vec![0u8; 16 * 1024];
    let mut opts = [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut vals = [log.as_mut_ptr() as *mut std::ffi::c_void, log.len() as *mut std::ffi::c_void];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `src` is a NUL-terminated PTX image; the option arrays have 2 entries each, the log
    // buffer has the length passed in its size option, and both outlive the call; the current
    // context was bound by the failed load just before.
    let r = unsafe { sys::cuModuleLoadDataEx(&mut module, src.as_ptr() as *const _, 2, opts.as_mut_ptr(), vals.as_mut_ptr()) };
    if r == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: `module` was just loaded by this function and is used nowhere else.
        unsafe { sys::cuModuleUnload(module) };
        return "(the second load succeeded)".into();
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    String::from_utf8_lossy(&log[..end]).trim().to_string()
}
