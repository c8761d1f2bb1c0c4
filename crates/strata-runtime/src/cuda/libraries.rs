//! Finding the CUDA libraries at run time: cudarc dlopens bare names (`libcuda.so.1`,
//! `libnvrtc.so.13`, ...), so strata searches the usual places, sets the loader path and re-execs once.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// A CUDA library strata may load, by the file name cudarc asks the loader for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaLibrary {
    /// What it is for, in words.
    pub role: &'static str,
    /// The name cudarc dlopens.
    pub file: &'static str,
    /// Other names the same library is installed under (a symlink to one is made when only it exists).
    pub aliases: &'static [&'static str],
}

/// The driver (only on machines with an NVIDIA GPU and driver).
pub const DRIVER: CudaLibrary = CudaLibrary {
    role: "CUDA driver",
    file: "libcuda.so.1",
    aliases: &["libcuda.so"],
};
/// The runtime kernel compiler.
pub const NVRTC: CudaLibrary = CudaLibrary {
    role: "NVRTC (kernel compiler)",
    file: "libnvrtc.so.13",
    aliases: &[],
};
/// Dense GEMMs.
pub const CUBLAS: CudaLibrary = CudaLibrary {
    role: "cuBLAS",
    file: "libcublas.so.13",
    aliases: &[],
};
/// Dense GEMMs with epilogues.
pub const CUBLASLT: CudaLibrary = CudaLibrary {
    role: "cuBLASLt",
    file: "libcublasLt.so.13",
    aliases: &[],
};
/// Collectives between GPUs.
pub const NCCL: CudaLibrary = CudaLibrary {
    role: "NCCL",
    file: "libnccl.so",
    aliases: &["libnccl.so.2"],
};

/// Everything the CUDA backend loads.
pub const ALL: [CudaLibrary; 5] = [DRIVER, NVRTC, CUBLAS, CUBLASLT, NCCL];

/// Set in the re-executed process so it never re-execs again.
const REEXEC_MARK: &str = "STRATA_CUDA_REEXEC";

/// Where strata looked and what it found.
#[derive(Debug, Clone, Default)]
pub struct LibrarySearch {
    /// Folders searched, in order.
    pub searched: Vec<PathBuf>,
    /// Each library found, with the folder it is in.
    pub found: Vec<(CudaLibrary, PathBuf)>,
    /// Libraries not found anywhere.
    pub missing: Vec<CudaLibrary>,
}

impl LibrarySearch {
    /// Whether `lib` was found.
    pub fn has(&self, lib: CudaLibrary) -> bool {
        self.found.iter().any(|(l, _)| *l == lib)
    }

    /// One line naming what is missing and where strata looked, for error messages.
    pub fn explain_missing(&self, libs: &[CudaLibrary]) -> String {
        let missing: Vec<String> = libs
            .iter()
            .filter(|l| !self.has(**l))
            .map(|l| format!("{} ({})", l.file, l.role))
            .collect();
        let dirs: Vec<String> = self.searched.iter().map(|d| d.display().to_string()).collect();
        format!(
            "not found: {}; looked in LD_LIBRARY_PATH and {}; install the CUDA 13 libraries or add their folder to STRATA_CUDA_LIB_PATH",
            missing.join(", "),
            dirs.join(":")
        )
    }
}

/// Folders that commonly hold CUDA libraries: `STRATA_CUDA_LIB_PATH`, `LD_LIBRARY_PATH`, the CUDA
/// toolkit and driver folders, the system library folders, strata's cache (the NVRTC wheel `make
/// test` fetches) and python's `site-packages/nvidia/*/lib` of every python found.
pub fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["STRATA_CUDA_LIB_PATH", "LD_LIBRARY_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let cache = std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/strata")));
    if let Some(cache) = cache {
        dirs.push(cache.join("cuda-libs"));
        dirs.extend(nvidia_wheel_lib_dirs(&cache.join("nvrtc")));
    }
    for site in python_site_dirs() {
        dirs.extend(nvidia_wheel_lib_dirs(&site));
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| d.is_dir() && seen.insert(d.clone()));
    dirs
}

/// `site-packages`-like folders of the pythons usually installed.
fn python_site_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = vec!["/usr/lib".into(), "/usr/local/lib".into()];
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(venv).join("lib"));
    }
    // Virtual environments under /opt (e.g. /opt/torch/.venv).
    for opt in read_dir_paths(Path::new("/opt")) {
        for venv in [".venv", "venv"] {
            roots.push(opt.join(venv).join("lib"));
        }
    }
    let mut out = Vec::new();
    for root in roots {
        for py in read_dir_paths(&root) {
            let name = py.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with("python3") {
                out.push(py.join("site-packages"));
                out.push(py.join("dist-packages"));
            }
        }
    }
    out
}

/// `ROOT/nvidia/*/lib` and `ROOT/nvidia/*/*/lib` (the wheels' layout, e.g. `nvidia/cu13/lib`).
fn nvidia_wheel_lib_dirs(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for pkg in read_dir_paths(&root.join("nvidia")) {
        out.push(pkg.join("lib"));
        for sub in read_dir_paths(&pkg) {
            out.push(sub.join("lib"));
        }
    }
    out
}

fn read_dir_paths(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Looks for every library in `dirs`.
pub fn search(dirs: &[PathBuf]) -> LibrarySearch {
    let mut s = LibrarySearch {
        searched: dirs.to_vec(),
        ..Default::default()
    };
    for lib in ALL {
        let hit = dirs.iter().find(|d| {
            std::iter::once(lib.file)
                .chain(lib.aliases.iter().copied())
                .any(|n| d.join(n).exists())
        });
        match hit {
            Some(d) => s.found.push((lib, d.clone())),
            None => s.missing.push(lib),
        }
    }
    s
}

/// Makes the CUDA libraries loadable by name for the rest of this process: when a library lives
/// in a folder the loader does not search, puts the folders on `LD_LIBRARY_PATH` and re-executes
/// the program once (the loader reads that variable only at start). Call first thing in `main`,
/// before any thread starts. Returns what was found; a missing library is not an error here
/// (a machine without a GPU has no driver): the backend reports it when it is asked for.
pub fn prepare() -> LibrarySearch {
    let found = search(&candidate_dirs());
    if std::env::var_os(REEXEC_MARK).is_some() {
        return found;
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    for (lib, dir) in &found.found {
        let dir = match link_alias(*lib, dir) {
            Some(d) => d,
            None => dir.clone(),
        };
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    let current: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    let new: Vec<PathBuf> = dirs.into_iter().filter(|d| !current.contains(d)).collect();
    if new.is_empty() {
        return found;
    }
    let path: OsString = match std::env::join_paths(new.iter().chain(current.iter())) {
        Ok(p) => p,
        Err(_) => return found,
    };
    reexec_with(path);
    found
}

/// When only an alias of `lib` exists in `dir` (e.g. `libnccl.so.2`), links the bare name to it in
/// strata's cache and returns that folder.
fn link_alias(lib: CudaLibrary, dir: &Path) -> Option<PathBuf> {
    if dir.join(lib.file).exists() {
        return None;
    }
    let alias = lib.aliases.iter().map(|a| dir.join(a)).find(|p| p.exists())?;
    let cache = std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/strata")))?;
    let links = cache.join("cuda-libs");
    std::fs::create_dir_all(&links).ok()?;
    let link = links.join(lib.file);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&alias, &link).ok()?;
    Some(links)
}

#[cfg(unix)]
fn reexec_with(ld_library_path: OsString) {
    use std::os::unix::process::CommandExt;
    let Ok(exe) = std::env::current_exe() else { return };
    let err = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", ld_library_path)
        .env(REEXEC_MARK, "1")
        .exec();
    // exec returns only on failure: carry on; the backend will report missing libraries.
    tracing::warn!("could not re-execute with the CUDA library path set: {err}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_finds_libraries_and_aliases_and_explains_what_is_missing() {
        let dir = std::env::temp_dir().join(format!("strata-libs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libnvrtc.so.13"), b"").unwrap();
        std::fs::write(dir.join("libnccl.so.2"), b"").unwrap();
        let s = search(std::slice::from_ref(&dir));
        assert!(s.has(NVRTC));
        assert!(s.has(NCCL), "libnccl.so.2 counts as NCCL");
        assert!(!s.has(DRIVER));
        let why = s.explain_missing(&[DRIVER, NVRTC]);
        assert!(why.contains("libcuda.so.1 (CUDA driver)"), "{why}");
        assert!(!why.contains("libnvrtc"), "{why}");
        assert!(why.contains(&dir.display().to_string()), "{why}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
