//! The output file: created hidden beside the destination, published only when complete.
//!
//! A reader must never see a half-written checkpoint, and an interrupted run must leave
//! nothing behind. So the data goes to an unnamed `O_TMPFILE` inode in the destination
//! folder (nothing to clean even after SIGKILL), which is fsynced and then linked into
//! place. Where the file system lacks `O_TMPFILE`, a named temp file held under `flock`
//! is used instead and removed on every error path; one that a killed run left behind is
//! removed by a later run in the same folder once it can take that lock
//! ([`remove_stale_temps`]). The lock, not a pid, says whether its writer is alive: a pid
//! means nothing across hosts or containers sharing the folder.
//!
//! Tests reach the named path with the failpoint `tmpfile=eopnotsupp`.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, Warning};
use crate::failpoint;
use crate::text::esc_path;
use crate::vocab::WarningKind;

/// The folder a destination path lives in.
pub fn parent_dir(dst: &Path) -> PathBuf {
    match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Free bytes for an unprivileged writer in `dir`.
pub fn free_space(dir: &Path) -> io::Result<u64> {
    let c = cstring(dir)?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

fn cstring(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn random_suffix() -> u64 {
    let mut x: u64 = 0;
    // SAFETY: writes at most 8 bytes into `x`.
    let n = unsafe { libc::getrandom((&mut x as *mut u64).cast(), 8, libc::GRND_NONBLOCK) };
    if n != 8 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        x = t ^ ((std::process::id() as u64) << 32);
    }
    x
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end])
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect()
}

/// A named temp file path beside `dst`: `.stcast-<host>-<pid>-<random>.tmp`.
fn temp_name(dir: &Path) -> PathBuf {
    dir.join(format!(
        ".stcast-{}-{}-{:016x}.tmp",
        hostname(),
        std::process::id(),
        random_suffix()
    ))
}

/// Take the exclusive lock that marks a temp file as alive, without waiting.
fn lock(f: &File) -> io::Result<()> {
    // SAFETY: flock on a descriptor we own; it touches no memory.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Does `path` still name the file open as `f`?
fn names_file(path: &Path, f: &File) -> bool {
    match (std::fs::symlink_metadata(path), f.metadata()) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Create and lock a named temp file in `dir`.
///
/// Between creating and locking it, a cleaner in another run may find the file unlocked and
/// remove it; so after locking, check that the name is still ours, else take a new name.
fn create_named(dir: &Path) -> Result<(File, PathBuf)> {
    let mut last = io::Error::from_raw_os_error(libc::EEXIST);
    for _ in 0..16 {
        let path = temp_name(dir);
        let f = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                last = e;
                continue;
            }
            Err(e) => return Err(Error::io(dir, "cannot create the output", e)),
        };
        match lock(&f) {
            // A cleaner holds it and is about to remove it.
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                last = e;
                continue;
            }
            // No locks on this file system: no cleaner can lock it either, so none removes it.
            _ => {}
        }
        if names_file(&path, &f) {
            return Ok((f, path));
        }
        last = io::Error::from_raw_os_error(libc::ENOENT);
    }
    Err(Error::io(dir, "cannot create the output", last))
}

/// Remove the named temp files (`.stcast-*.tmp`) in `dir` whose lock nobody holds: they
/// were left by a run that was killed. Returns one note per file removed.
///
/// A file is removed only while we hold its lock and only if its name still points at the
/// file we locked. A live writer, in this process, another one or on another host sharing
/// the folder, holds its lock until it is done, so it is never touched; where the file
/// system offers no locks nothing is removed. Errors only mean a file is left alone.
pub fn remove_stale_temps(dir: &Path) -> Vec<Warning> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut notes = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.as_bytes();
        if !(name.starts_with(b".stcast-") && name.ends_with(b".tmp")) {
            continue;
        }
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let path = entry.path();
        // Read-write: where flock is emulated with POSIX locks (NFS), LOCK_EX needs it.
        let Ok(f) = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
        else {
            continue;
        };
        if lock(&f).is_err() || !names_file(&path, &f) {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            notes.push(Warning::new(
                WarningKind::StaleTemp,
                format!(
                    "removed {}, a temp file left by an interrupted stcast run (its lock was \
                     free)",
                    esc_path(&path)
                ),
            ));
        }
    }
    notes
}

enum Kind {
    /// `O_TMPFILE`: no name until published.
    Anonymous,
    /// A visible temp file, removed on drop unless published.
    Named(PathBuf),
}

/// An output file that is not yet visible under its final name.
pub struct TempOutput {
    pub file: File,
    dst: PathBuf,
    dir: PathBuf,
    kind: Kind,
    force: bool,
    published: bool,
}

impl TempOutput {
    /// Create the hidden output in `dst`'s folder, with the mode a new file (or, under
    /// `force`, the replaced file) would have.
    pub fn create(dst: &Path, force: bool, replaced_mode: Option<u32>) -> Result<TempOutput> {
        let dir = parent_dir(dst);
        failpoint::hit("create").map_err(|e| Error::io(&dir, "cannot create the output", e))?;
        let anon = failpoint::hit("tmpfile").and_then(|()| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .mode(0o666)
                .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
                .open(&dir)
        });
        let (file, kind) = match anon {
            Ok(f) => {
                // Locked too: under --force it is briefly linked under a temp name.
                let _ = lock(&f);
                (f, Kind::Anonymous)
            }
            Err(e) if is_tmpfile_unsupported(&e) => {
                let (f, path) = create_named(&dir)?;
                (f, Kind::Named(path))
            }
            Err(e) => return Err(Error::io(&dir, "cannot create the output", e)),
        };
        let out = TempOutput {
            file,
            dst: dst.to_path_buf(),
            dir,
            kind,
            force,
            published: false,
        };
        if let Some(mode) = replaced_mode {
            out.file
                .set_permissions(std::fs::Permissions::from_mode(mode & 0o777))
                .map_err(|e| Error::io(&out.dst, "cannot set the file mode", e))?;
        }
        Ok(out)
    }

    /// Reserve `len` bytes, failing early and clearly when the disk is too small.
    pub fn preallocate(&self, len: u64) -> Result<()> {
        let no_space = |have: u64| Error::NoSpace {
            dir: self.dir.clone(),
            need: len,
            have,
        };
        let have = free_space(&self.dir).map_err(|e| Error::io(&self.dir, "statvfs", e))?;
        if have < len {
            return Err(no_space(have));
        }
        let fp = failpoint::hit("prealloc");
        // SAFETY: fallocate on our own descriptor; the range is within i64 since len came
        // from a plan bounded by the input size.
        let rc = match fp {
            Ok(()) => unsafe { libc::fallocate(self.file.as_raw_fd(), 0, 0, len as i64) },
            Err(_) => -1,
        };
        if rc == 0 {
            return Ok(());
        }
        let err = fp.err().unwrap_or_else(io::Error::last_os_error);
        match err.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
                Err(no_space(free_space(&self.dir).unwrap_or(0)))
            }
            // Some NFS and FUSE mounts cannot preallocate; the statvfs check above stands in.
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => self
                .file
                .set_len(len)
                .map_err(|e| Error::io(&self.dst, "cannot size the output", e)),
            _ => Err(Error::io(&self.dst, "cannot preallocate the output", err)),
        }
    }

    /// fsync the data, give the file its final name, fsync the folder.
    pub fn publish(mut self) -> Result<()> {
        failpoint::hit("fsync").map_err(|e| Error::io(&self.dst, "fsync", e))?;
        self.file
            .sync_all()
            .map_err(|e| Error::io(&self.dst, "fsync", e))?;
        failpoint::hit("publish").map_err(|e| Error::io(&self.dst, "cannot publish", e))?;
        match &self.kind {
            Kind::Anonymous => self.link_anonymous()?,
            Kind::Named(tmp) => {
                let tmp = tmp.clone();
                self.rename_named(&tmp)?;
            }
        }
        self.published = true;
        let dir = File::open(&self.dir).map_err(|e| Error::io(&self.dir, "open folder", e))?;
        dir.sync_all()
            .map_err(|e| Error::io(&self.dir, "fsync folder", e))?;
        Ok(())
    }

    fn link_anonymous(&mut self) -> Result<()> {
        if self.force {
            // linkat cannot replace a name: link under a temp name, then rename over.
            let tmp = temp_name(&self.dir);
            self.link_to(&tmp)?;
            self.kind = Kind::Named(tmp.clone());
            return self.rename_named(&tmp);
        }
        self.link_to(&self.dst.clone()).map_err(|e| match e {
            Error::Io { source, .. } if source.kind() == io::ErrorKind::AlreadyExists => {
                Error::DestinationExists {
                    path: self.dst.clone(),
                }
            }
            e => e,
        })
    }

    fn link_to(&self, target: &Path) -> Result<()> {
        let fd_path = CString::new(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
            .expect("no NUL in a formatted path");
        let c_target = cstring(target).map_err(|e| Error::io(target, "link", e))?;
        // SAFETY: both paths are valid C strings; linkat does not retain them.
        let rc = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                fd_path.as_ptr(),
                libc::AT_FDCWD,
                c_target.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ENOENT) {
            return Err(Error::io(target, "cannot publish", err));
        }
        // No /proc: AT_EMPTY_PATH does the same (it needs CAP_DAC_READ_SEARCH).
        let empty = CString::new("").expect("empty C string");
        // SAFETY: as above; the descriptor is ours and open.
        let rc = unsafe {
            libc::linkat(
                self.file.as_raw_fd(),
                empty.as_ptr(),
                libc::AT_FDCWD,
                c_target.as_ptr(),
                libc::AT_EMPTY_PATH,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::io(
                target,
                "cannot publish",
                io::Error::last_os_error(),
            ))
        }
    }

    fn rename_named(&self, tmp: &Path) -> Result<()> {
        if self.force {
            return std::fs::rename(tmp, &self.dst)
                .map_err(|e| Error::io(&self.dst, "cannot publish", e));
        }
        let (a, b) = match (cstring(tmp), cstring(&self.dst)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Err(Error::io(&self.dst, "cannot publish", e)),
        };
        // SAFETY: valid C strings; renameat2 does not retain them.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EEXIST) => Err(Error::DestinationExists {
                path: self.dst.clone(),
            }),
            // No RENAME_NOREPLACE here: link() also refuses an existing name.
            Some(libc::EINVAL) | Some(libc::ENOSYS) => match std::fs::hard_link(tmp, &self.dst) {
                Ok(()) => {
                    let _ = std::fs::remove_file(tmp);
                    Ok(())
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    Err(Error::DestinationExists {
                        path: self.dst.clone(),
                    })
                }
                Err(e) => Err(Error::io(&self.dst, "cannot publish", e)),
            },
            _ => Err(Error::io(&self.dst, "cannot publish", err)),
        }
    }
}

fn is_tmpfile_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL)
    )
}

impl Drop for TempOutput {
    fn drop(&mut self) {
        if let Kind::Named(tmp) = &self.kind {
            if !self.published {
                let _ = std::fs::remove_file(tmp);
            }
        }
    }
}
