//! The PTX builder: turns `kernels-gpu` into two PTX modules, one per [`Module`] (sm_90a with
//! every kernel, sm_80 with the portable ones), and (with `ptxas`) into cubins and a resource
//! report. Used by `host/build.rs` (so a plain `cargo build` of the host embeds fresh PTX) and by
//! `cargo xtask build-ptx` (which also assembles and checks every entry point).
//!
//! Steps, each a fact recorded in `../shared/TOOLCHAIN.md`:
//! 1. the nightly toolchain (`LMHEAD_NIGHTLY`, default `nightly`) gets the `rust-src` and
//!    `llvm-tools` components if they are missing;
//! 2. `cargo build --release --target nvptx64-nvidia-cuda -Zbuild-std=core` with fat LTO, and a
//!    linker shim (`-C linker=`) that keeps the LTO'd bitcode instead of calling the missing
//!    `llvm-bitcode-linker`;
//! 3. the Hopper module: `llc -O3 -mcpu=sm_90a -mattr=+ptx80` from the nightly's `llvm-tools`
//!    on the whole bitcode;
//! 4. the portable module: the same bitcode with every entry but the portable ones internalised
//!    and removed (`opt -passes=internalize,globaldce`), then `llc -O3 -mcpu=sm_80 -mattr=+ptx80`
//!    (one rustc build, two lowerings: NVPTX takes the subtarget from `-mcpu` alone, so the
//!    functions' `target-cpu` attribute from the build does not carry over);
//! 5. every entry gets `.maxntid <threads>, 1, 1` from the candidate tables, so `ptxas` knows the
//!    block size it allocates registers for;
//! 6. optionally `ptxas -arch=<module's arch> -v` (PyPI wheel `nvidia-cuda-nvcc`, fetched into
//!    `.tools/`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

pub use lmhead_core::config::Module;

pub type Result<T> = std::result::Result<T, String>;

/// The pinned ptxas wheel.
pub const PTXAS_WHEEL: &str = "nvidia-cuda-nvcc==13.5.37";
/// The GPU architecture the Hopper module is built for (H100/H200 with the `a` features: wgmma,
/// setmaxnreg); [`Module::arch`] names each module's.
pub const ARCH: &str = "sm_90a";

/// Entry points allowed a stack frame or spills, with the reason. Empty: every kernel must have
/// 0 bytes of stack and no spills.
pub const RESOURCE_ALLOWLIST: &[(&str, &str)] = &[];

/// Where the builder works.
#[derive(Clone, Debug)]
pub struct Paths {
    /// The repository root (holds `kernels-gpu/`).
    pub root: PathBuf,
    /// Cargo target directory of the nvptx build.
    pub target_dir: PathBuf,
}

impl Paths {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        let target_dir = root.join("target").join("kernels");
        Self { root, target_dir }
    }

    pub fn kernel_dir(&self) -> PathBuf {
        self.root.join("kernels-gpu")
    }

    /// Where ptxas is installed: `LMHEAD_TOOLS_DIR`, else `<root>/.tools`.
    pub fn tools_dir(&self) -> PathBuf {
        match std::env::var_os("LMHEAD_TOOLS_DIR") {
            Some(d) if !d.is_empty() => PathBuf::from(d),
            _ => self.root.join(".tools"),
        }
    }
}

/// The toolchain the kernels are built with.
pub fn nightly() -> String {
    std::env::var("LMHEAD_NIGHTLY").unwrap_or_else(|_| "nightly".into())
}

fn run(cmd: &mut Command, what: &str) -> Result<std::process::Output> {
    let out = cmd.output().map_err(|e| format!("{what}: could not start {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(out)
}

/// A `rustup run <nightly> <tool>` command with the outer cargo's environment removed, so that a
/// build script's `RUSTC`, `RUSTFLAGS`, target dir and jobserver do not leak into the nested build.
fn nightly_command(tool: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.arg("run").arg(nightly()).arg(tool);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        let leak = k.starts_with("CARGO_")
            || k.starts_with("RUSTC")
            || k.starts_with("RUSTDOC")
            || matches!(
                k.as_str(),
                "RUSTFLAGS" | "RUSTUP_TOOLCHAIN" | "OUT_DIR" | "TARGET" | "HOST" | "NUM_JOBS" | "OPT_LEVEL" | "PROFILE" | "DEBUG"
            );
        if leak && k != "CARGO_HOME" {
            cmd.env_remove(&k);
        }
    }
    cmd
}

/// Make sure the nightly toolchain exists and has `rust-src` and `llvm-tools`; install the
/// components if missing (prints what it does to stderr).
pub fn ensure_toolchain() -> Result<()> {
    let tc = nightly();
    let out = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", &tc])
        .output()
        .map_err(|e| format!("rustup is needed to build the kernels (not found: {e})"))?;
    if !out.status.success() {
        return Err(format!(
            "the toolchain `{tc}` is not installed (set LMHEAD_NIGHTLY to another nightly): {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let installed = String::from_utf8_lossy(&out.stdout);
    let missing: Vec<&str> = ["rust-src", "llvm-tools"].into_iter().filter(|c| !installed.lines().any(|l| l.starts_with(c))).collect();
    if !missing.is_empty() {
        eprintln!("lmhead-build: installing {missing:?} for toolchain {tc}");
        let mut cmd = Command::new("rustup");
        cmd.args(["component", "add", "--toolchain", &tc]).args(&missing);
        run(&mut cmd, "rustup component add")?;
    }
    Ok(())
}

/// Directory of `llc` and friends in the nightly sysroot.
pub fn llvm_bin() -> Result<PathBuf> {
    let out = run(nightly_command("rustc").arg("--print").arg("sysroot"), "rustc --print sysroot")?;
    let sysroot = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let host = run(nightly_command("rustc").arg("-vV"), "rustc -vV")?;
    let host = String::from_utf8_lossy(&host.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .ok_or("rustc -vV printed no host triple")?;
    Ok(PathBuf::from(sysroot).join("lib/rustlib").join(host).join("bin"))
}

const LINKER_SHIM: &str = r#"#!/bin/sh
# Linker shim for the nvptx64 build (written by lmhead-build): rustc hands the linker the
# fat-LTO bitcode object and the output path; keep the bitcode beside the output as `<out>.bc`.
out=""; obj=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    *.o) obj="$1" ;;
  esac
  shift
done
[ -n "$out" ] && [ -n "$obj" ] || { echo "lmhead linker shim: no -o or .o in arguments" >&2; exit 1; }
cp "$obj" "$out.bc" && : > "$out"
"#;

/// Threads per block of every entry point of `module`, from the candidate tables.
pub fn entry_threads(module: Module) -> BTreeMap<String, u32> {
    let mut m = BTreeMap::new();
    for (name, c) in lmhead_core::config::tuned_entries() {
        if module.holds(c.mainloop) {
            m.insert(name, c.threads());
        }
    }
    for name in module.fixed() {
        m.insert(name.to_string(), lmhead_core::config::fixed::THREADS);
    }
    m
}

/// Insert `.maxntid` after the parameter list of every entry of `module`. Fails on an entry that
/// is not in the module's tables (it would run with an unknown block size) and on a missing one.
pub fn add_launch_bounds(ptx: &str, module: Module) -> Result<String> {
    let threads = entry_threads(module);
    let mut out = String::with_capacity(ptx.len() + 64 * threads.len());
    // (threads, warp-specialised) of the entry whose parameter list is open.
    let mut pending: Option<(u32, bool)> = None;
    let mut seen = 0usize;
    let mut bounded = 0usize;
    for line in ptx.lines() {
        if let Some(rest) = line.trim_start().strip_prefix(".visible .entry ") {
            let name = rest.split('(').next().unwrap_or("").trim();
            let t = *threads.get(name).ok_or_else(|| format!("PTX entry `{name}` is not in the {} module's tables", module.name()))?;
            pending = Some((t, name.ends_with("_tma")));
            seen += 1;
        }
        out.push_str(line);
        out.push('\n');
        // llc ends the parameter list with `)` and, for some entries, a `// @name` comment.
        if pending.is_some() && line.split("//").next().unwrap_or("").trim() == ")" {
            let (t, specialised) = pending.take().unwrap();
            writeln!(out, ".maxntid {t}, 1, 1").unwrap();
            bounded += 1;
            // Warp-specialised kernels move registers with `setmaxnreg`, which ptxas only honours
            // when it knows the per-thread count at entry: one block per SM fixes it at
            // 65 536 / threads.
            if specialised {
                writeln!(out, ".minnctapersm 1").unwrap();
            }
        }
    }
    if seen != threads.len() {
        return Err(format!("{} PTX has {seen} entries, the tables name {}", module.name(), threads.len()));
    }
    if bounded != seen {
        return Err(format!("launch bounds added to {bounded} of {seen} entries: the end of a parameter list was not recognised"));
    }
    Ok(out)
}

/// The two modules' PTX text (with launch bounds).
#[derive(Clone, Debug)]
pub struct Built {
    pub hopper: String,
    pub portable: String,
}

impl Built {
    pub fn ptx(&self, module: Module) -> &str {
        match module {
            Module::Hopper => &self.hopper,
            Module::Portable => &self.portable,
        }
    }
}

/// The file stem of `module`'s PTX and cubin in a build directory (`kernels.ptx` and
/// `kernels_sm80.ptx` in the host's `OUT_DIR`; `lmhead_kernels[_sm80].ptx` in the kernel target).
pub fn stem(base: &str, module: Module) -> String {
    match module {
        Module::Hopper => base.to_string(),
        Module::Portable => format!("{base}_sm80"),
    }
}

/// Build the kernels once and lower them into both modules ([`Built`]).
pub fn build_modules(paths: &Paths) -> Result<Built> {
    ensure_toolchain()?;
    std::fs::create_dir_all(&paths.target_dir).map_err(|e| e.to_string())?;
    let shim = paths.target_dir.join("lmhead-linker-shim.sh");
    std::fs::write(&shim, LINKER_SHIM).map_err(|e| format!("writing {}: {e}", shim.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())?;
    }
    let rustflags = format!("-C target-cpu={ARCH} -C target-feature=+ptx80 -C linker={}", shim.display());
    let mut cmd = nightly_command("cargo");
    cmd.args(["build", "--release", "--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core", "--manifest-path"])
        .arg(paths.kernel_dir().join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&paths.target_dir)
        .env("RUSTFLAGS", rustflags);
    run(&mut cmd, "building kernels-gpu for nvptx64")?;
    let bc = paths.target_dir.join("nvptx64-nvidia-cuda/release/deps/lmhead_kernels.ptx.bc");
    if !bc.exists() {
        return Err(format!("the linker shim left no bitcode at {}", bc.display()));
    }
    let bin = llvm_bin()?;
    // The files after the cargo build are this process's own (a test build and a release build
    // of the host may lower at once).
    let tag = std::process::id();
    let lower = |module: Module, input: &Path| -> Result<String> {
        let raw = paths.target_dir.join(format!("{}.raw-{tag}.ptx", stem("lmhead_kernels", module)));
        let mut cmd = Command::new(bin.join("llc"));
        cmd.args(["-O3", &format!("-mcpu={}", module.arch()), "-mattr=+ptx80"]).arg(input).arg("-o").arg(&raw);
        let done =
            run(&mut cmd, &format!("llc for {}", module.arch())).and_then(|_| std::fs::read_to_string(&raw).map_err(|e| e.to_string()));
        let _ = std::fs::remove_file(&raw);
        add_launch_bounds(&done?, module)
    };
    let hopper = lower(Module::Hopper, &bc)?;
    // The portable module: only its entries stay external; everything else is internalised and
    // dropped by global DCE before lowering for sm_80.
    let keep = paths.target_dir.join(format!("portable-entries-{tag}.txt"));
    let names: Vec<String> = entry_threads(Module::Portable).into_keys().collect();
    std::fs::write(&keep, names.join("\n") + "\n").map_err(|e| format!("writing {}: {e}", keep.display()))?;
    let portable_bc = paths.target_dir.join(format!("lmhead_kernels_sm80-{tag}.bc"));
    let mut cmd = Command::new(bin.join("opt"));
    cmd.arg("-passes=internalize,globaldce")
        .arg(format!("-internalize-public-api-file={}", keep.display()))
        .arg(&bc)
        .arg("-o")
        .arg(&portable_bc);
    let kept = run(&mut cmd, "opt (keeping the portable entries)");
    let _ = std::fs::remove_file(&keep);
    let portable = kept.and_then(|_| lower(Module::Portable, &portable_bc));
    let _ = std::fs::remove_file(&portable_bc);
    let portable = portable?;
    Ok(Built { hopper, portable })
}

/// Build the kernels and return the Hopper module's PTX text (with launch bounds).
pub fn build_ptx(paths: &Paths) -> Result<String> {
    Ok(build_modules(paths)?.hopper)
}

/// Find `ptxas`: `LMHEAD_PTXAS`, then the `.tools/` cache. With `install`, fetch the pinned wheel
/// with pip and extract `ptxas` into the cache.
pub fn ptxas(paths: &Paths, install: bool) -> Result<Option<PathBuf>> {
    if let Ok(p) = std::env::var("LMHEAD_PTXAS") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            return Err(format!("LMHEAD_PTXAS={} is not a file", p.display()));
        }
        return Ok(Some(p));
    }
    let cached = paths.tools_dir().join("ptxas");
    if cached.exists() {
        return Ok(Some(cached));
    }
    if !install {
        return Ok(None);
    }
    eprintln!("lmhead-build: fetching ptxas from the PyPI wheel {PTXAS_WHEEL} into {}", paths.tools_dir().display());
    // Several build scripts may install at once (a test and a release build of the host): each
    // works in its own folder and the last step is an atomic rename onto the same file.
    let tag = std::process::id();
    let dl = paths.tools_dir().join(format!("wheel-{tag}"));
    std::fs::create_dir_all(&dl).map_err(|e| format!("creating {}: {e}", dl.display()))?;
    let python = if Command::new("python3").arg("--version").output().is_ok() { "python3" } else { "python" };
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", PTXAS_WHEEL, "-d"]).arg(&dl);
    let fetched = run(&mut cmd, "pip download");
    let result = fetched.and_then(|_| {
        let extract = "import glob,zipfile,sys\nw=sorted(glob.glob(sys.argv[1]+'/nvidia_cuda_nvcc-*.whl'))[-1]\nz=zipfile.ZipFile(w)\nopen(sys.argv[2],'wb').write(z.read('nvidia/cu13/bin/ptxas'))\n";
        let tmp = paths.tools_dir().join(format!("ptxas.part-{tag}"));
        let mut cmd = Command::new(python);
        cmd.args(["-c", extract]).arg(&dl).arg(&tmp);
        run(&mut cmd, "extracting ptxas from the wheel")?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())?;
        }
        std::fs::rename(&tmp, &cached).map_err(|e| e.to_string())
    });
    let _ = std::fs::remove_dir_all(&dl);
    result?;
    Ok(Some(cached))
}

/// What `ptxas -v` reports for one function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub registers: u32,
    pub stack: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub static_smem: u32,
    pub is_entry: bool,
}

/// Parse `ptxas -v` output into per-function resources.
pub fn parse_ptxas(report: &str) -> BTreeMap<String, Resources> {
    let mut out: BTreeMap<String, Resources> = BTreeMap::new();
    let mut cur: Option<String> = None;
    for line in report.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.entry(name.clone()).or_default().is_entry = true;
            cur = Some(name);
        } else if let Some(i) = line.find("Function properties for ") {
            let name = line[i + "Function properties for ".len()..].trim().to_string();
            out.entry(name.clone()).or_default();
            cur = Some(name);
        } else if let Some(name) = &cur {
            let r = out.get_mut(name).unwrap();
            let nums = |s: &str, key: &str| -> Option<u32> {
                let i = s.find(key)?;
                s[..i].split_whitespace().last()?.parse().ok()
            };
            if line.contains("stack frame") {
                r.stack = nums(line, "bytes stack frame").unwrap_or(0);
                r.spill_stores = nums(line, "bytes spill stores").unwrap_or(0);
                r.spill_loads = nums(line, "bytes spill loads").unwrap_or(0);
            }
            if let Some(n) = nums(line, "registers") {
                r.registers = n;
            }
            if let Some(n) = nums(line, "bytes smem") {
                r.static_smem = n;
            }
        }
    }
    out
}

/// What `ptxas -v` said about a module: per-function resources, and its "Potential Performance
/// Loss" notes (e.g. C7508 `setmaxnreg` ignored, C7514/C7517 `wgmma` serialised), which name no
/// function but are defects all the same.
pub struct Report {
    pub resources: BTreeMap<String, Resources>,
    pub perf_warnings: Vec<String>,
}

/// The "Potential Performance Loss" lines of a ptxas report.
pub fn perf_warnings(report: &str) -> Vec<String> {
    let mut w: Vec<String> = report.lines().filter(|l| l.contains("Potential Performance Loss")).map(|l| l.trim().to_string()).collect();
    w.dedup();
    w
}

/// Assemble `module`'s PTX at `ptx_path` with `ptxas` for its architecture and return the parsed
/// report (and write the cubin).
pub fn assemble(ptxas: &Path, ptx_path: &Path, cubin: &Path, module: Module) -> Result<Report> {
    let mut cmd = Command::new(ptxas);
    cmd.args([&format!("-arch={}", module.arch()), "-v"]).arg(ptx_path).arg("-o").arg(cubin);
    let out = run(&mut cmd, "ptxas")?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Ok(Report { resources: parse_ptxas(&text), perf_warnings: perf_warnings(&text) })
}

/// The resource table of `module`, and the list of violations (stack, spills, non-inlined
/// functions) that the allowlist does not excuse.
pub fn resource_table(res: &BTreeMap<String, Resources>, module: Module) -> (String, Vec<String>) {
    let threads = entry_threads(module);
    let mut table = String::new();
    writeln!(table, "{:<48} {:>7} {:>5} {:>8} {:>6} {:>7}", "entry", "threads", "regs", "smem_dyn", "stack", "spills").unwrap();
    let mut bad = Vec::new();
    for (name, r) in res {
        if !r.is_entry {
            bad.push(format!("{}: `{name}` is a separate device function (not inlined): calls cost a stack frame", module.name()));
            continue;
        }
        let smem = smem_of(name).map(|b| b.to_string()).unwrap_or_else(|| "-".into());
        writeln!(
            table,
            "{:<48} {:>7} {:>5} {:>8} {:>6} {:>7}",
            name,
            threads.get(name).copied().unwrap_or(0),
            r.registers,
            smem,
            r.stack,
            r.spill_stores + r.spill_loads
        )
        .unwrap();
        let excused = RESOURCE_ALLOWLIST.iter().any(|(n, _)| n == name);
        if (r.stack > 0 || r.spill_stores > 0 || r.spill_loads > 0) && !excused {
            bad.push(format!("{}: `{name}`: {} bytes stack, {} + {} bytes spilled", module.name(), r.stack, r.spill_stores, r.spill_loads));
        }
    }
    (table, bad)
}

/// Dynamic shared memory of an entry, as the host launches it.
fn smem_of(name: &str) -> Option<usize> {
    lmhead_core::config::entry_smem_bytes(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_report() {
        let text = "ptxas info    : 0 bytes gmem\nptxas info    : Compiling entry function 'k1' for 'sm_90a'\nptxas info    : Function properties for k1\n    24 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\nptxas info    : Used 164 registers, used 1 barriers, 24 bytes cumulative stack size\nptxas info    : Function properties for helper\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
        let r = parse_ptxas(text);
        assert_eq!(r["k1"], Resources { registers: 164, stack: 24, spill_stores: 8, spill_loads: 4, static_smem: 0, is_entry: true });
        assert!(!r["helper"].is_entry);
        let (_, bad) = resource_table(&r, Module::Hopper);
        assert_eq!(bad.len(), 2, "{bad:?}");
    }

    #[test]
    fn performance_loss_notes_are_collected_once() {
        let note = "ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine register count at entry.";
        let text = format!("{note}\n{note}\nptxas info    : Compiling entry function 'k1' for 'sm_90a'\n");
        assert_eq!(perf_warnings(&text), [note.trim().to_string()]);
        assert!(perf_warnings("ptxas info    : Used 10 registers\n").is_empty());
    }

    #[test]
    fn launch_bounds_follow_the_tables() {
        let threads = entry_threads(Module::Hopper);
        let mut ptx = String::new();
        // Both forms llc writes: a bare `)` and `)  // @name`.
        for (i, (name, _)) in threads.iter().enumerate() {
            let close = if i % 2 == 0 { ")".to_string() } else { format!(")                   // @{name}") };
            ptx.push_str(&format!(".visible .entry {name}(\n\t.param .align 8 .b8 {name}_param_0[96]\n{close}\n{{\n\tret;\n}}\n"));
        }
        let out = add_launch_bounds(&ptx, Module::Hopper).unwrap();
        assert_eq!(out.matches(".maxntid").count(), threads.len());
        assert!(out.contains(".maxntid 256, 1, 1"));
        let tma = threads.keys().filter(|n| n.ends_with("_tma")).count();
        assert!(tma > 0);
        assert_eq!(out.matches(".minnctapersm 1").count(), tma);
        assert!(out.contains(".maxntid 384, 1, 1\n.minnctapersm 1"));
        // An unrecognised end of the parameter list is an error, not a kernel without bounds.
        let name = threads.keys().next().unwrap();
        assert!(add_launch_bounds(&format!(".visible .entry {name}(\n) extra\n{{\n}}\n"), Module::Hopper).is_err());
        assert!(add_launch_bounds(".visible .entry unknown(\n)\n{\n}\n", Module::Hopper).is_err());
        // The Hopper module's PTX is not the portable one's: its Sm90 entries are unknown there.
        assert!(add_launch_bounds(&ptx, Module::Portable).is_err());
    }

    #[test]
    fn the_portable_module_holds_the_mma_sync_kernels_their_keep_twins_and_no_sm90_one() {
        let hopper = entry_threads(Module::Hopper);
        let portable = entry_threads(Module::Portable);
        assert!(portable.keys().all(|n| hopper.contains_key(n)));
        for (name, c) in lmhead_core::config::tuned_entries() {
            assert_eq!(portable.contains_key(&name), !c.is_sm90(), "{name} {c:?}");
        }
        assert!(!portable.keys().any(|n| n.ends_with("_tma") || n.contains("unit_")), "{portable:?}");
        for f in [lmhead_core::config::fixed::FWD_MERGE, lmhead_core::config::fixed::DLOGITS_KEPT] {
            assert!(portable.contains_key(f), "{f}");
        }
    }
}
