//! The persistent tuning cache: one JSON file per device fingerprint (name, SM version, driver).
//!
//! Format (a compatibility boundary: new fields get `#[serde(default)]`):
//! `{"format": 2, "header": {"ptx_hash", "candidates", "device"}, "entries": [[key, entry], …]}`.
//! The header's PTX hash and candidate-table checksum make a file written for other kernels
//! stale: it is ignored with a warning and retuned, never trusted (the cache is local: a new
//! build retunes, nothing shipped depends on the kernels' bytes). Format 1 files (written while
//! a shipped table decided most keys) read as stale. A corrupt or truncated file is
//! also ignored with a warning. Writes are atomic (temporary file + rename) and serialised
//! across processes by an advisory lock on `<file>.lock`; each write re-reads the file and merges,
//! so two processes tuning different keys at once both keep their results.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Entry, TuneKey};

/// Current file format.
pub const FORMAT: u32 = 2;

/// What makes a cache file valid for this build on this device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub ptx_hash: String,
    pub candidates: String,
    pub device: String,
}

impl Header {
    pub fn current(device: &str) -> Self {
        Self { ptx_hash: crate::ptx::ptx_hash(), candidates: candidates_checksum(), device: device.to_string() }
    }
}

/// A checksum of every family's candidate list (a changed table invalidates old results).
pub fn candidates_checksum() -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for f in lmhead_core::Family::ALL {
        h.update(format!("{f:?}{:?}", f.candidates()).as_bytes());
    }
    crate::ptx::short_hex(&h.finalize())
}

#[derive(Serialize, Deserialize)]
struct File {
    format: u32,
    header: Header,
    entries: Vec<(TuneKey, Entry)>,
}

/// The cache: in memory, and in a file when `path` is set.
#[derive(Debug)]
pub struct Cache {
    path: Option<PathBuf>,
    header: Header,
    entries: BTreeMap<TuneKey, Entry>,
    /// Warnings from loading (also printed to stderr).
    pub warnings: Vec<String>,
}

/// `LMHEAD_TUNE_CACHE` (a file, or `off`), else `<user cache dir>/lmhead/<fingerprint>.json`.
pub fn default_path(fingerprint: &str) -> Option<PathBuf> {
    match std::env::var("LMHEAD_TUNE_CACHE") {
        Ok(v) if v == "off" => None,
        Ok(v) => Some(PathBuf::from(v)),
        Err(_) => dirs::cache_dir().map(|d| d.join("lmhead").join(format!("{fingerprint}.json"))),
    }
}

fn warn(warnings: &mut Vec<String>, msg: String) {
    eprintln!("lmhead: warning: {msg}");
    warnings.push(msg);
}

/// Read a cache file: `Ok(None)` if absent, `Err(reason)` if unusable.
fn read(path: &Path, header: &Header) -> Result<Option<BTreeMap<TuneKey, Entry>>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read tuning cache {}: {e}", path.display())),
    };
    let f: File = serde_json::from_str(&text).map_err(|e| format!("tuning cache {} is corrupt ({e}); retuning", path.display()))?;
    if f.format != FORMAT {
        return Err(format!("tuning cache {} has format {} (this build reads {FORMAT}); retuning", path.display(), f.format));
    }
    if &f.header != header {
        return Err(format!("tuning cache {} was written for other kernels or another device ({:?}); retuning", path.display(), f.header));
    }
    Ok(Some(f.entries.into_iter().collect()))
}

impl Cache {
    /// Open the cache at `path` (or in memory only), loading what is valid.
    pub fn open(path: Option<PathBuf>, device: &str) -> Self {
        Self::open_with_header(path, Header::current(device))
    }

    /// As [`Cache::open`] with an explicit header (tests simulate other builds).
    pub fn open_with_header(path: Option<PathBuf>, header: Header) -> Self {
        let mut warnings = Vec::new();
        let mut entries = BTreeMap::new();
        if let Some(p) = &path {
            match read(p, &header) {
                Ok(Some(e)) => entries = e,
                Ok(None) => {}
                Err(msg) => warn(&mut warnings, msg),
            }
        }
        Self { path, header, entries, warnings }
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn get(&self, key: &TuneKey) -> Option<Entry> {
        self.entries.get(key).cloned()
    }

    pub fn all(&self) -> BTreeMap<TuneKey, Entry> {
        self.entries.clone()
    }

    /// Record `entry` and persist (merging with what other processes wrote meanwhile). A failed
    /// write (read-only directory, full disk) is a warning: the result stays in memory.
    pub fn insert(&mut self, key: TuneKey, entry: Entry) {
        self.entries.insert(key, entry);
        if let Err(msg) = self.persist() {
            let mut w = std::mem::take(&mut self.warnings);
            warn(&mut w, msg);
            self.warnings = w;
        }
    }

    fn persist(&mut self) -> Result<(), String> {
        let Some(path) = self.path.clone() else { return Ok(()) };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}; tuning results stay in memory", dir.display()))?;
        let lock_path = path.with_extension("json.lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| format!("cannot open {}: {e}; tuning results stay in memory", lock_path.display()))?;
        lock.lock().map_err(|e| format!("cannot lock {}: {e}", lock_path.display()))?;
        // Merge: entries another process wrote since we loaded stay; ours win on equal keys.
        if let Ok(Some(theirs)) = read(&path, &self.header) {
            for (k, v) in theirs {
                self.entries.entry(k).or_insert(v);
            }
        }
        let file = File {
            format: FORMAT,
            header: self.header.clone(),
            entries: self.entries.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        };
        let text = serde_json::to_string_pretty(&file).map_err(|e| e.to_string())?;
        let tmp = path.with_extension(format!("json.tmp.{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        let r = write().map_err(|e| format!("cannot write tuning cache {}: {e}; results stay in memory", path.display()));
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        let _ = lock.unlock();
        r
    }
}
