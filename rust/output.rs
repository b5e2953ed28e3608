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
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, Warning};
use crate::failpoint;
use crate::text::esc_path;
use crate::vocab::{Side, Taken, WarningKind};

/// The folder a destination path lives in.
pub fn parent_dir(dst: &Path) -> PathBuf {
    match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Does `path` as written name a folder: ending with `/`, `/.` or `/..` (or being `.` or
/// `..`)? `Path` drops such endings (its `file_name` and `parent` of `out/` are those of
/// `out`), but the final `linkat` or `rename` onto it fails, after all the work.
pub fn names_a_folder(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let last = path
        .as_os_str()
        .as_bytes()
        .rsplit(|&c| c == b'/')
        .next()
        .unwrap_or_default();
    matches!(last, b"" | b"." | b"..")
}

/// The folders to create for `dir` to exist, outermost first: none when it is a folder;
/// `Err(path)` when the nearest ancestor that exists (`path`) is not a folder.
pub fn missing_dirs(dir: &Path) -> std::result::Result<Vec<PathBuf>, PathBuf> {
    let mut missing = Vec::new();
    let mut at = dir.to_path_buf();
    loop {
        match std::fs::metadata(&at) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => return Err(at),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            // ENOTDIR and the like: an ancestor is not a folder; name it if it can be found
            // (`Path::parent` skips a `.` component, so this does not push on).
            Err(_) => {
                let mut up = at.as_path();
                while let Some(p) = up.parent().filter(|p| !p.as_os_str().is_empty()) {
                    match std::fs::symlink_metadata(p) {
                        Ok(m) if !m.is_dir() => return Err(p.to_path_buf()),
                        Ok(_) => break,
                        Err(_) => up = p,
                    }
                }
                return Err(at);
            }
        }
        missing.push(at.clone());
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p.to_path_buf(),
            _ => break,
        }
    }
    missing.reverse();
    Ok(missing)
}

/// `os.path.dirname`: `path` up to its last `/`, without the `/`s that end it (but a root
/// of `/`s stays).
fn dirname(path: &[u8]) -> &[u8] {
    let head = &path[..path.iter().rposition(|&c| c == b'/').map_or(0, |at| at + 1)];
    if head.iter().all(|&c| c == b'/') {
        return head;
    }
    &head[..head.len() - head.iter().rev().take_while(|&&c| c == b'/').count()]
}

/// `dir`, or the nearest of its ancestors that is a folder (where a folder to be is
/// created), spelled from `dir`'s own words as messages show it: a relative path stays
/// relative (`""` is `.`).
pub fn nearest_dir(dir: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let mut at = dir.as_os_str().as_bytes().to_vec();
    if at.is_empty() {
        at.push(b'.');
    }
    while !Path::new(std::ffi::OsStr::from_bytes(&at)).is_dir() {
        let trimmed = &at[..at.len() - at.iter().rev().take_while(|&&c| c == b'/').count()];
        let parent = match dirname(trimmed) {
            b"" if at.starts_with(b"/") => at.clone(),
            b"" => b".".to_vec(),
            up => up.to_vec(),
        };
        if parent == at {
            break;
        }
        at = parent;
    }
    PathBuf::from(std::ffi::OsString::from_vec(at))
}

/// Where an output `dst` (a file, or a folder to create or fill) would be written: the
/// folder that holds it, or will (`nearest_dir`), its free bytes, and whether `need` fit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Space {
    pub folder: PathBuf,
    pub free: u64,
    pub fits: bool,
}

/// The space for `need` bytes written to `dst` (a dry run's check).
pub fn space(dst: &Path, need: u64) -> Result<Space> {
    let folder = if dst.is_dir() {
        dst.to_path_buf()
    } else {
        let up = dirname(dst.as_os_str().as_bytes());
        nearest_dir(Path::new(std::ffi::OsStr::from_bytes(up)))
    };
    let free = free_space(&folder).map_err(|e| Error::io(&folder, "statvfs", e))?;
    Ok(Space {
        fits: free >= need,
        folder,
        free,
    })
}

/// The folders one output created for its destination (`mkdir -p`), removed again (when
/// still empty, and still the very folder made: device and inode) if it is dropped before
/// `keep`: a failed run leaves nothing behind, and never removes a folder put in its place.
#[derive(Debug, Default)]
pub struct MadeDirs {
    made: Vec<(PathBuf, (u64, u64))>,
}

impl MadeDirs {
    /// Create the missing folders above `dst` (only once every check has passed).
    pub fn for_output(dst: &Path) -> Result<MadeDirs> {
        let dir = parent_dir(dst);
        let missing = missing_dirs(&dir).map_err(|at| Error::NoDestinationFolder {
            dir: at,
            exists: true,
        })?;
        let mut made = MadeDirs::default();
        for d in missing {
            match std::fs::create_dir(&d) {
                Ok(()) => match std::fs::symlink_metadata(&d) {
                    Ok(m) => made.made.push((d, (m.dev(), m.ino()))),
                    Err(e) => return Err(Error::io(&d, "cannot create the folder", e)),
                },
                // Made meanwhile by someone else: theirs, not ours to remove.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && d.is_dir() => {}
                Err(e) => return Err(Error::io(&d, "cannot create the folder", e)),
            }
        }
        Ok(made)
    }

    /// The output was published: the folders stay.
    pub fn keep(mut self) {
        self.made.clear();
    }
}

impl Drop for MadeDirs {
    fn drop(&mut self) {
        for (d, id) in self.made.iter().rev() {
            let ours =
                std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir() && (m.dev(), m.ino()) == *id);
            if ours {
                let _ = std::fs::remove_dir(d);
            }
        }
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

/// The block a file takes room in on the file system of `dir` (its fragment size); 1 where
/// statvfs fails.
pub fn block_size(dir: &Path) -> u64 {
    let block = cstring(dir).ok().and_then(|c| {
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter.
        (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_frsize as u64)
    });
    block.filter(|&b| b > 0).unwrap_or(1)
}

fn cstring(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// 64 random bits from the kernel (a time and pid mix if it has none to give).
pub(crate) fn random_suffix() -> u64 {
    let mut x: u64 = 0;
    // The system call, not glibc's wrapper (glibc 2.25): the release wheel is manylinux2014
    // (glibc 2.17), where a call to the wrapper fails the import (scripts/build-wheel.sh).
    // SAFETY: writes at most 8 bytes into `x`.
    let n = unsafe {
        libc::syscall(
            libc::SYS_getrandom,
            (&mut x as *mut u64).cast::<libc::c_void>(),
            8usize,
            libc::GRND_NONBLOCK,
        )
    };
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

/// A named temp file path in `dir`: `.stcast-<host>-<pid>[-<tag>]-<random>.tmp`. The
/// host, pid and tag say whose it is; its lock, not these, says whether it is alive.
fn temp_name(dir: &Path, tag: &str) -> PathBuf {
    let tag: String = tag
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(32)
        .collect();
    let tag = if tag.is_empty() {
        String::new()
    } else {
        format!("-{tag}")
    };
    dir.join(format!(
        ".stcast-{}-{}{tag}-{:016x}.tmp",
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
/// The file is created as `.stcast-*.new`, a name cleaners leave alone, locked, and only
/// then renamed to its `.tmp` name: a cleaner in another run never sees it unlocked, so it
/// never removes a live run's temp (nor says it did).
fn create_named(dir: &Path, tag: &str) -> Result<(File, PathBuf)> {
    let mut last = io::Error::from_raw_os_error(libc::EEXIST);
    for _ in 0..16 {
        let path = temp_name(dir, tag);
        let fresh = path.with_extension("new");
        let f = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(&fresh)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                last = e;
                continue;
            }
            Err(e) => return Err(Error::io(dir, "cannot create the output", e)),
        };
        // Where the file system has no locks, no cleaner can lock it either: none removes it.
        let _ = lock(&f);
        match rename_noreplace(&fresh, &path) {
            Ok(()) => return Ok((f, path)),
            Err(e) => {
                let _ = std::fs::remove_file(&fresh);
                if e.kind() != io::ErrorKind::AlreadyExists {
                    return Err(Error::io(dir, "cannot create the output", e));
                }
                last = e;
            }
        }
    }
    Err(Error::io(dir, "cannot create the output", last))
}

/// rename(2) that never replaces `to`: renameat2(RENAME_NOREPLACE), or link(2) then
/// unlink(2) where the file system lacks it. An existing `to` is `AlreadyExists`.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let (a, b) = (cstring(from)?, cstring(to)?);
    // The system call, not glibc's wrapper (glibc 2.28): see `random_suffix`. A kernel
    // without it answers ENOSYS, handled below.
    // SAFETY: valid C strings; renameat2 does not retain them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
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
        Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            std::fs::hard_link(from, to)?;
            let _ = std::fs::remove_file(from);
            Ok(())
        }
        _ => Err(err),
    }
}

/// How old an unlocked `.stcast-*.new` file must be before a cleaner removes it: such a file
/// only stays when a run is killed between creating and renaming its temp.
const STALE_NEW_SECS: u64 = 3600;

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
        let fresh = name.ends_with(b".new");
        if !(name.starts_with(b".stcast-") && (name.ends_with(b".tmp") || fresh)) {
            continue;
        }
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        // A `.new` file is a temp being created (see `create_named`) unless it is old.
        let age = meta.modified().ok().and_then(|t| t.elapsed().ok());
        if fresh && age.is_none_or(|a| a.as_secs() < STALE_NEW_SECS) {
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

/// What publishing may do to a file already at the destination's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replace {
    /// Nothing: an existing name is `Error::DestinationExists`, checked atomically.
    No,
    /// Replace it, whatever it is (the caller was told to: `force`).
    Any,
    /// Replace it only if it is still the file stcast wrote, known by device and inode
    /// (a folder's manifest records them); a missing name is created.
    Same { dev: u64, ino: u64 },
}

/// What was published: its device, inode and size, for a manifest to record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Published {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
}

/// As the front ends record it: (dev, ino, size).
impl From<Published> for (u64, u64, u64) {
    fn from(p: Published) -> (u64, u64, u64) {
        (p.dev, p.ino, p.size)
    }
}

/// An output sealed and not yet published (its data durable, only its name missing): what
/// a front end publishes once it has recorded it (a folder run's manifest), or not at all.
pub trait Sealed {
    /// The hidden output's device, inode and size, as they will be once published.
    fn identity(&self) -> Result<Published>;
    /// The SHA-256 of its safetensors header (length prefix and JSON) as written, for an
    /// output that has one: what a front end's record of it names, never a plan's guess.
    fn header_sha256(&self) -> Option<String> {
        None
    }
}

impl Sealed for TempOutput {
    fn identity(&self) -> Result<Published> {
        TempOutput::identity(self)
    }
}

enum Kind {
    /// `O_TMPFILE`: no name until published.
    Anonymous,
    /// A visible temp file, removed on drop unless published.
    Named(PathBuf),
}

/// An output file that is not yet visible under its final name.
///
/// Every file stcast writes goes through here: converted files, reports, manifests,
/// indexes, configs and copies. Dropping it unpublished leaves nothing behind.
pub struct TempOutput {
    pub file: File,
    dst: PathBuf,
    dir: PathBuf,
    kind: Kind,
    replace: Replace,
    tag: String,
    published: bool,
}

impl TempOutput {
    /// Create the hidden output in `dst`'s folder with `mode` (default `0666 & ~umask`).
    /// `tag` goes into a named temp's name (a run's shard, say), for whoever finds it.
    pub fn create(
        dst: &Path,
        replace: Replace,
        mode: Option<u32>,
        tag: &str,
    ) -> Result<TempOutput> {
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
                // Locked too: under `Replace` it is briefly linked under a temp name.
                let _ = lock(&f);
                (f, Kind::Anonymous)
            }
            Err(e) if is_tmpfile_unsupported(&e) => {
                let (f, path) = create_named(&dir, tag)?;
                (f, Kind::Named(path))
            }
            Err(e) => return Err(Error::io(&dir, "cannot create the output", e)),
        };
        let out = TempOutput {
            file,
            dst: dst.to_path_buf(),
            dir,
            kind,
            replace,
            tag: tag.to_string(),
            published: false,
        };
        if let Some(mode) = mode {
            // Never setuid, setgid or sticky: only the permission bits.
            out.file
                .set_permissions(std::fs::Permissions::from_mode(mode & 0o777))
                .map_err(|e| Error::io(&out.dst, "cannot set the file mode", e))?;
        }
        Ok(out)
    }

    /// The destination this output will be published as.
    pub fn dst(&self) -> &Path {
        &self.dst
    }

    /// Reserve `len` bytes, failing early and clearly when the disk is too small.
    pub fn preallocate(&self, len: u64) -> Result<()> {
        let no_space = |have: u64| Error::NoSpace {
            dir: self.dir.clone(),
            need: len,
            have,
            folder: false,
        };
        let have = free_space(&self.dir).map_err(|e| Error::io(&self.dir, "statvfs", e))?;
        if have < len {
            return Err(no_space(have));
        }
        let fp = failpoint::hit("prealloc");
        // SAFETY: fallocate on our own descriptor; the range is within i64 since len came
        // from a plan bounded by the input size. An empty file needs nothing (and
        // fallocate refuses a zero length with EINVAL).
        let rc = match fp {
            Ok(()) if len == 0 => 0,
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

    /// Make the data durable (fsync): after this only the name is missing.
    pub fn seal(&self) -> Result<()> {
        failpoint::hit("fsync").map_err(|e| Error::io(&self.dst, "fsync", e))?;
        self.file
            .sync_all()
            .map_err(|e| Error::io(&self.dst, "fsync", e))
    }

    /// The hidden file's device, inode and size: what it will be once published (a link
    /// or a rename keeps the inode), for a manifest to record before it has a name.
    pub fn identity(&self) -> Result<Published> {
        let meta = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.dst, "cannot stat the output", e))?;
        Ok(Published {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
        })
    }

    /// Give the sealed file its final name, then fsync the folder. This is the commit
    /// point: before it nothing is visible, after it the file stays.
    pub fn publish(mut self) -> Result<Published> {
        failpoint::hit("publish").map_err(|e| Error::io(&self.dst, "cannot publish", e))?;
        self.check_replaced()?;
        match &self.kind {
            Kind::Anonymous => self.link_anonymous()?,
            Kind::Named(tmp) => {
                let tmp = tmp.clone();
                self.rename_named(&tmp)?;
            }
        }
        self.published = true;
        let meta = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.dst, "cannot stat the output", e))?;
        // The name is in place; a folder that cannot be fsynced (some network file systems)
        // still holds it, so that is not a failure.
        if let Ok(dir) = File::open(&self.dir) {
            let _ = dir.sync_all();
        }
        Ok(Published {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
        })
    }

    /// Under `Replace::Same`, refuse to replace a file that is not the one stcast wrote.
    fn check_replaced(&self) -> Result<()> {
        let Replace::Same { dev, ino } = self.replace else {
            return Ok(());
        };
        match std::fs::symlink_metadata(&self.dst) {
            Ok(m) if (m.dev(), m.ino()) != (dev, ino) => Err(Error::NotOurs {
                path: self.dst.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Does publishing replace an existing name?
    fn replaces(&self) -> bool {
        match self.replace {
            Replace::No => false,
            Replace::Any => true,
            Replace::Same { .. } => std::fs::symlink_metadata(&self.dst).is_ok(),
        }
    }

    fn link_anonymous(&mut self) -> Result<()> {
        if self.replaces() {
            // linkat cannot replace a name: link under a temp name, then rename over.
            let tmp = temp_name(&self.dir, &self.tag);
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
        if self.replaces() {
            // rename() replaces the name itself, never what a symlink there points to.
            return std::fs::rename(tmp, &self.dst)
                .map_err(|e| Error::io(&self.dst, "cannot publish", e));
        }
        rename_noreplace(tmp, &self.dst).map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Error::DestinationExists {
                    path: self.dst.clone(),
                }
            } else {
                Error::io(&self.dst, "cannot publish", e)
            }
        })
    }
}

/// Write `bytes` as the file `dst`, whole or not at all: a hidden temp, fsync, publish.
pub fn write_file(dst: &Path, bytes: &[u8], replace: Replace, tag: &str) -> Result<Published> {
    sealed_file(dst, bytes, replace, tag)?.publish()
}

/// `write_file` up to the publish: the hidden file, written and sealed.
pub fn sealed_file(dst: &Path, bytes: &[u8], replace: Replace, tag: &str) -> Result<TempOutput> {
    let out = TempOutput::create(dst, replace, None, tag)?;
    out.preallocate(bytes.len() as u64)?;
    failpoint::hit("write-temp").map_err(|e| Error::io(dst, "write failed", e))?;
    (&out.file)
        .write_all(bytes)
        .map_err(|e| Error::io(dst, "write failed", e))?;
    out.seal()?;
    Ok(out)
}

/// A copy of a regular file in progress, step by step (a companion file of a folder can be
/// large). Exactly the size `fstat` gave at the start is copied; a source that yields more
/// or fewer bytes is an error naming it.
pub struct Copy {
    src: PathBuf,
    from: File,
    out: TempOutput,
    size: u64,
    done: u64,
}

/// Bytes copied per call: bounded memory, and a visit to the caller in between.
const COPY_CHUNK: usize = 1 << 20;

impl Copy {
    /// Open `src` (never blocking; only a regular file) and create the hidden copy of it at
    /// `dst`, with `src`'s permission bits.
    pub fn new(src: &Path, dst: &Path, replace: Replace, tag: &str) -> Result<Copy> {
        let (from, meta) = crate::source::open_regular(src)?;
        let out = TempOutput::create(dst, replace, Some(meta.mode()), tag)?;
        out.preallocate(meta.len())?;
        Ok(Copy {
            src: src.to_path_buf(),
            from,
            out,
            size: meta.len(),
            done: 0,
        })
    }

    /// Bytes copied and in all.
    pub fn progress(&self) -> (u64, u64) {
        (self.done, self.size)
    }

    /// Copy about `budget` bytes; true once all are copied (and the source has no more).
    pub fn step(&mut self, budget: u64) -> Result<bool> {
        let mut buf = vec![0u8; COPY_CHUNK];
        let mut spent = 0u64;
        while self.done < self.size && spent < budget {
            let want = (self.size - self.done).min(COPY_CHUNK as u64) as usize;
            let n = read_at(&self.from, &mut buf[..want], self.done)
                .map_err(|e| Error::io(&self.src, "cannot read", e))?;
            if n == 0 {
                return Err(Error::InputChanged {
                    path: self.src.clone(),
                    change: format!(
                        "it ended after {} of the {} bytes its size gave",
                        self.done, self.size
                    ),
                });
            }
            (&self.out.file)
                .write_all(&buf[..n])
                .map_err(|e| Error::io(self.out.dst(), "write failed", e))?;
            self.done += n as u64;
            spent += n as u64;
        }
        if self.done < self.size {
            return Ok(false);
        }
        // Read past the size said: a file that grew, or a pseudo-file of /proc that says 0
        // bytes. A page's worth, as some of those refuse reads of odd sizes (EINVAL).
        let more = buf.len().min(4096);
        match read_at(&self.from, &mut buf[..more], self.size) {
            Ok(0) => Ok(true),
            Ok(_) => Err(Error::InputChanged {
                path: self.src.clone(),
                change: format!("it holds more than the {} bytes its size gave", self.size),
            }),
            Err(e) => Err(Error::io(&self.src, "cannot read", e)),
        }
    }

    /// Seal the copy: only its name is missing then.
    pub fn seal(self) -> Result<TempOutput> {
        self.out.seal()?;
        Ok(self.out)
    }
}

fn read_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    use std::os::unix::fs::FileExt;
    loop {
        match f.read_at(buf, offset) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
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

/// Who a path names, whether or not it exists yet: the file it reaches (device and inode,
/// through symlinks) and the slot it would be created in (its folder's device and inode,
/// and its name). Two paths are the same when either agrees: hard links, symlinks, `..`
/// and bind mounts all resolve to the same identity; strings do not decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathId {
    pub file: Option<(u64, u64)>,
    pub slot: Option<(u64, u64, std::ffi::OsString)>,
}

impl PathId {
    pub fn of(path: &Path) -> PathId {
        let file = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
        let slot = path.file_name().and_then(|name| {
            std::fs::metadata(parent_dir(path))
                .ok()
                .map(|m| (m.dev(), m.ino(), name.to_os_string()))
        });
        PathId { file, slot }
    }

    /// Do the two name the same file, or the same not-yet-created name?
    pub fn same(&self, other: &PathId) -> bool {
        (self.file.is_some() && self.file == other.file)
            || (self.slot.is_some() && self.slot == other.slot)
    }
}

/// Entries of one folder looked at for its identities (a DCP folder of 10,000 ranks lists
/// 10,001 names).
const MAX_ENTRIES: usize = 100_000;

/// Deeper than any real tree: a bound on the walk up a folder's parents.
const MAX_DEPTH: usize = 4096;

/// The identities (device, inode) of the folder `dir` (the nearest that exists of it and its
/// ancestors, by the path's words) and of every folder above it, by the kernel's `..`: a
/// symlink, `..` or a bind mount leads to the same chain as the real path does.
pub fn folder_chain(dir: &Path) -> Vec<(u64, u64)> {
    let start = nearest_dir(dir);
    let mut out = Vec::new();
    let Ok(c) = cstring(&start) else {
        return out;
    };
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
    // SAFETY: a valid C path; the descriptor is ours and closed below.
    let mut fd = unsafe { libc::open(c.as_ptr(), flags) };
    let up = CString::new("..").expect("no NUL");
    for _ in 0..MAX_DEPTH {
        if fd < 0 {
            break;
        }
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open and `st` a properly sized out-parameter.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            break;
        }
        let here = (st.st_dev, st.st_ino);
        if out.last() == Some(&here) {
            break; // the root is its own parent
        }
        out.push(here);
        // SAFETY: `fd` is an open folder and `up` a valid C string; the old descriptor is
        // closed once the parent is open.
        let parent = unsafe { libc::openat(fd, up.as_ptr(), flags) };
        unsafe { libc::close(fd) };
        fd = parent;
    }
    if fd >= 0 {
        // SAFETY: ours, open.
        unsafe { libc::close(fd) };
    }
    out
}

/// What a source is made of, and what else a run writes, by identity: the paths no output
/// may be (a file, or a name not yet created: `PathId`) and the folders no output may lie in
/// (a checkpoint folder and the folders inside it, through links too: a ZeRO tag folder that
/// is a link leads to its real folder). Every path a run writes is checked against it before
/// the first byte: the destination, the report, a folder run's outputs.
#[derive(Debug, Default)]
pub struct Territory {
    names: Vec<(PathId, PathBuf, Taken)>,
    folders: Vec<((u64, u64), PathBuf, Taken)>,
}

/// What a path would overwrite or land in (`Territory::clash`).
#[derive(Debug)]
pub struct Clash {
    pub taken: Taken,
    /// The folder it lies in; `None`: it is the file (or name) itself.
    pub folder: Option<PathBuf>,
}

impl Territory {
    /// The file (or name to be created) `path`.
    pub fn add_name(&mut self, path: &Path, taken: Taken) {
        self.names
            .push((PathId::of(path), path.to_path_buf(), taken));
    }

    /// A folder that is all `taken`: nothing may be written inside it. Its entries are
    /// looked at one level down, followed: a file or folder there that is a link leads out
    /// of it, and what it leads to is part of it too.
    pub fn add_folder(&mut self, dir: &Path, taken: Taken) {
        let Ok(m) = std::fs::metadata(dir) else {
            return;
        };
        self.folders
            .push(((m.dev(), m.ino()), dir.to_path_buf(), taken));
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.take(MAX_ENTRIES).flatten() {
            let linked = e.file_type().is_ok_and(|t| t.is_symlink());
            let path = e.path();
            match std::fs::metadata(&path) {
                Ok(m) if linked && m.is_dir() => {
                    self.folders.push(((m.dev(), m.ino()), path, taken));
                }
                Ok(m) if linked && m.is_file() => {
                    self.names.push((PathId::of(&path), path, taken));
                }
                _ => {}
            }
        }
    }

    /// What the source is made of: its files, and the checkpoint folders it was read from.
    pub fn of_source(src: &crate::source::Source) -> Territory {
        let mut t = Territory::default();
        for f in &src.files {
            t.add_name(&f.path, Taken::Input);
        }
        for d in &src.folders {
            t.add_folder(d, Taken::Input);
        }
        t
    }

    /// Add `path`: a folder as `add_folder`, anything else as `add_name`.
    pub fn add(&mut self, path: &Path, taken: Taken) {
        if path.is_dir() {
            self.add_folder(path, taken);
        } else {
            self.add_name(path, taken);
        }
    }

    /// Is `path` one of the names, or does it lie inside one of the folders (its folder's
    /// chain of parents, by identity, meets one)?
    pub fn clash(&self, path: &Path) -> Option<Clash> {
        let id = PathId::of(path);
        if let Some((_, _, taken)) = self.names.iter().find(|(n, _, _)| n.same(&id)) {
            return Some(Clash {
                taken: *taken,
                folder: None,
            });
        }
        if self.folders.is_empty() {
            return None;
        }
        let chain = folder_chain(&parent_dir(path));
        self.folders
            .iter()
            .find(|(f, _, _)| chain.contains(f))
            .map(|(_, dir, taken)| Clash {
                taken: *taken,
                folder: Some(dir.clone()),
            })
    }

    /// Refuse `path`, which a run writes as `role`, where it clashes.
    pub fn check(&self, path: &Path, role: Side) -> Result<()> {
        let Some(clash) = self.clash(path) else {
            return Ok(());
        };
        let path = path.to_path_buf();
        Err(match (clash.folder, role) {
            (Some(folder), role) => Error::InsideFolder {
                path,
                role,
                folder,
                taken: clash.taken,
            },
            (None, Side::Output) => Error::DestinationIsInput { path },
            (None, role) => Error::SideOutput {
                path,
                role: role.name(),
                what: clash.taken.what(),
            },
        })
    }
}

/// Check where a side output (`role`: "report") would go, before any work: its folder must
/// exist, it must not be in `taken` (the inputs and the output, by identity: a file, or
/// inside a folder), nor a folder, FIFO or device; an existing file needs `force`; a file
/// must be creatable in its folder (a hidden one is, and goes: a folder run publishes its
/// output before its report, which must not fail then). Returns how to publish it.
pub fn check_side_output(
    path: &Path,
    role: Side,
    force: bool,
    taken: &Territory,
) -> Result<Replace> {
    let refuse = |what| {
        Err(Error::SideOutput {
            path: path.to_path_buf(),
            role: role.name(),
            what,
        })
    };
    if path.file_name().is_none() || names_a_folder(path) {
        return refuse("path names no file");
    }
    taken.check(path, role)?;
    match std::fs::metadata(parent_dir(path)) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return refuse("folder is not a folder"),
        Err(_) => return refuse("folder does not exist"),
    }
    let replace = match at_path(path) {
        AtPath::Nothing => Replace::No,
        AtPath::Folder => return refuse("path is a folder"),
        AtPath::Special => return refuse("path is not a regular file (a FIFO, socket or device)"),
        AtPath::File { .. } if !force => {
            return Err(Error::DestinationExists {
                path: path.to_path_buf(),
            })
        }
        AtPath::File { .. } => Replace::Any,
    };
    // As the side output will be written: a hidden file in its folder (never published).
    drop(TempOutput::create(path, replace, None, role.name())?);
    Ok(replace)
}

/// `check_side_output` for a folder run's report: not the source `src` nor inside it (any
/// kind: its folders, a ZeRO tag folder through a link), nor the destination `dst` or
/// inside it.
pub fn check_report_path(path: &Path, force: bool, src: &Path, dst: &Path) -> Result<Replace> {
    let mut territory = Territory::default();
    territory.add(src, Taken::Input);
    territory.add(dst, Taken::Output);
    check_side_output(path, Side::Report, force, &territory)
}

/// What an output path names now, as the checks before any work see it.
pub enum AtPath {
    Nothing,
    /// A regular file, or a symlink (dangling, or to a regular file): what `force` may
    /// replace. Publishing replaces the name, never what a link points to. `followed`: the
    /// file a link leads to, if any.
    File {
        followed: Option<std::fs::Metadata>,
    },
    /// A folder, or a link to one.
    Folder,
    /// A FIFO, socket or device, or a link to one: never replaced.
    Special,
}

/// Classify `path` without following it first (a dangling symlink exists: publishing onto
/// it would fail after the work, or replace it unasked), then by what a link leads to.
pub fn at_path(path: &Path) -> AtPath {
    let Ok(own) = std::fs::symlink_metadata(path) else {
        return AtPath::Nothing;
    };
    let followed = std::fs::metadata(path).ok();
    let types = [
        Some(own.file_type()),
        followed.as_ref().map(|m| m.file_type()),
    ];
    if types.iter().flatten().any(|t| t.is_dir()) {
        return AtPath::Folder;
    }
    let plain = |t: &std::fs::FileType| t.is_file() || t.is_symlink();
    if types.iter().flatten().all(plain) {
        return AtPath::File { followed };
    }
    AtPath::Special
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_folder_is_spelled_from_the_path_s_words() {
        let dir = scratch("nearest");
        std::fs::write(dir.join("file"), "x").unwrap();
        let near = |p: &Path| nearest_dir(p);
        assert_eq!(near(&dir.join("new/deeper/")), dir);
        assert_eq!(near(&dir.join("new//deeper")), dir);
        assert_eq!(near(&dir), dir);
        assert_eq!(near(&dir.join("file")), dir);
        assert_eq!(near(Path::new("")), Path::new("."));
        assert_eq!(near(Path::new("no-such-folder-stcast/a/b")), Path::new("."));
        assert_eq!(near(Path::new("/no-such-folder-stcast/a")), Path::new("/"));
        for (path, want) in [
            ("a//b", "a"),
            ("//b", "//"),
            ("/", "/"),
            ("a", ""),
            ("a/b/", "a/b"),
        ] {
            assert_eq!(dirname(path.as_bytes()), want.as_bytes(), "{path}");
        }
    }

    #[test]
    fn a_dry_run_s_space_is_that_of_the_folder_the_output_goes_into() {
        let dir = scratch("space");
        let s = space(&dir.join("new/out.safetensors"), 1).unwrap();
        assert_eq!((s.folder.as_path(), s.fits), (dir.as_path(), true));
        assert_eq!(s.free, free_space(&dir).unwrap());
        let s = space(&dir, u64::MAX).unwrap();
        assert_eq!((s.folder.as_path(), s.fits), (dir.as_path(), false));
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("stcast-out-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_territory_holds_its_folders_through_links_and_by_any_path() {
        let dir = scratch("territory");
        let (ck, real) = (dir.join("ck"), dir.join("real-tag"));
        std::fs::create_dir_all(ck.join("sub")).unwrap();
        std::fs::create_dir_all(&real).unwrap();
        std::fs::write(ck.join("latest"), "tag").unwrap();
        std::fs::write(real.join("rank.pt"), "x").unwrap();
        std::os::unix::fs::symlink(&real, ck.join("tag")).unwrap();
        std::os::unix::fs::symlink(&ck, dir.join("to-ck")).unwrap();
        let mut t = Territory::default();
        t.add(&ck, Taken::Input);
        let inside = [
            ck.join("latest"),
            ck.join("new.json"),
            ck.join("sub/a/b/new.json"),
            ck.join("sub/../x"),
            ck.join("tag/rank.pt"),
            real.join("new.json"),
            dir.join("to-ck/new.json"),
        ];
        for p in &inside {
            let clash = t.clash(p).unwrap_or_else(|| panic!("{}", p.display()));
            assert_eq!(clash.taken, Taken::Input);
            assert!(clash.folder.is_some(), "{}", p.display());
            let e = t.check(p, Side::Report).unwrap_err();
            assert!(matches!(e, Error::InsideFolder { .. }), "{e:?}");
        }
        for p in [dir.join("o.json"), dir.join("ck-bf16/model.safetensors")] {
            assert!(t.clash(&p).is_none(), "{}", p.display());
        }
        // A file of a source read from no folder: only itself (and its other names).
        let mut t = Territory::default();
        t.add(&real.join("rank.pt"), Taken::Input);
        t.add_name(&dir.join("out.safetensors"), Taken::Output);
        std::os::unix::fs::symlink(real.join("rank.pt"), dir.join("l.json")).unwrap();
        let e = t.check(&dir.join("l.json"), Side::Output).unwrap_err();
        assert!(matches!(e, Error::DestinationIsInput { .. }), "{e:?}");
        let clash = t.clash(&dir.join("out.safetensors")).unwrap();
        assert_eq!((clash.taken, clash.folder), (Taken::Output, None));
        assert!(t.clash(&real.join("beside.json")).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_folder_chain_follows_the_kernel_not_the_words() {
        let dir = scratch("chain");
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::os::unix::fs::symlink(dir.join("a/b"), dir.join("l")).unwrap();
        let id = |p: &Path| {
            let m = std::fs::metadata(p).unwrap();
            (m.dev(), m.ino())
        };
        // `l/..` is `a`, not `dir`: the link's target's parent.
        let chain = folder_chain(&dir.join("l/missing/deeper"));
        assert_eq!(
            &chain[..3],
            &[id(&dir.join("a/b")), id(&dir.join("a")), id(&dir)]
        );
        assert_eq!(chain.last(), Some(&id(Path::new("/"))));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
