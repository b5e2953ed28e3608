//! An opened input: its file, a read-only map of it and its validated header.
//!
//! Opening never blocks (FIFOs) and never reads more than the file's `fstat` size says:
//! the header is parsed from the map, which is exactly that size. The size and mtime taken
//! at open are checked again before each window and before publishing, so that a changed
//! input is reported instead of converted half old, half new.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};

use crate::error::{Error, Result};
use crate::header::{self, SourceHeader, PREFIX};
use crate::torch::Format;

/// An opened, validated input.
pub struct Source {
    pub path: PathBuf,
    pub file: File,
    pub map: Mmap,
    pub header: SourceHeader,
    /// Size and mtime when opened: a write to the file changes one of them.
    stamp: Stamp,
}

/// What `fstat` says about the input's content: its size and mtime (in nanoseconds).
///
/// Not ctime: renaming the file, replacing its name by another file (which is how most
/// tools save) or a chmod change ctime but not the bytes we read from the open inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp(u64, (i64, i64));

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp(m.len(), (m.mtime(), m.mtime_nsec()))
    }
}

/// Open `path` for reading without blocking, and refuse anything but a regular file.
pub fn open_regular(path: &Path) -> Result<(File, std::fs::Metadata)> {
    // O_NONBLOCK: opening a FIFO for reading must not wait for a writer.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(path, "cannot open the input", e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io(path, "cannot stat the input", e))?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let what = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_char_device() || ft.is_block_device() {
            "a device"
        } else {
            "not a regular file"
        };
        return Err(Error::NotAFile {
            path: path.to_path_buf(),
            what,
        });
    }
    Ok((file, meta))
}

impl Source {
    /// Open and validate `path` without reading its data.
    pub fn open(path: &Path) -> Result<Source> {
        let (file, meta) = open_regular(path)?;
        if meta.len() < PREFIX as u64 {
            // Nothing to map. A file whose size says so is never read: pseudo-files
            // (`/proc/...`) report 0 bytes and then yield any amount.
            return Err(Error::invalid_header(
                path,
                format!(
                    "header too small: the file is {} bytes, the header length alone takes {PREFIX}",
                    meta.len()
                ),
            ));
        }
        // SAFETY: the map is read-only. Another process truncating the file while we run
        // would fault (SIGBUS); that is the usual contract of reading through mmap. Readers
        // check the size before each window (`check_unchanged`), which narrows this to a
        // truncation during the read of one window.
        let map =
            unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "cannot map the input", e))?;
        let header = header::read_header(path, &map).map_err(|e| {
            // Another format's reasons to fail as safetensors mislead: name the format.
            match crate::torch::sniff(&map) {
                Format::Safetensors | Format::Unknown => e,
                other => Error::OtherFormat {
                    path: path.to_path_buf(),
                    what: other.describe(),
                },
            }
        })?;
        Ok(Source {
            path: path.to_path_buf(),
            file,
            map,
            header,
            stamp: Stamp::of(&meta),
        })
    }

    /// Device and inode of the open file.
    pub fn identity(&self) -> Result<(u64, u64)> {
        let m = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, "cannot stat the input", e))?;
        Ok((m.dev(), m.ino()))
    }

    /// Fail if the file was written to (or truncated, or extended) since it was opened.
    ///
    /// Called before each window is read, so that a truncated input is reported instead of
    /// faulting on pages past its new end, and after the last read, so that a rewritten
    /// input is never published as a mix of old and new bytes.
    pub fn check_unchanged(&self) -> Result<()> {
        let now = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, "cannot stat the input", e))?;
        let now = Stamp::of(&now);
        if now == self.stamp {
            return Ok(());
        }
        let change = if now.0 != self.stamp.0 {
            format!("its size went from {} to {} bytes", self.stamp.0, now.0)
        } else {
            "it was modified".to_string()
        };
        Err(Error::InputChanged {
            path: self.path.clone(),
            change,
        })
    }

    /// Drop the pages of an absolute byte range that we are done with, and any mapped
    /// again behind it by fault-around (see `FAULT_AROUND_MAX`).
    pub fn release(&self, (a, b): (u64, u64)) {
        let from = a.saturating_sub(FAULT_AROUND_MAX);
        // SAFETY: the map is read-only and shared; dropping its pages only means a later
        // read faults them in again from the file. No reference into the range is alive.
        unsafe {
            let _ = self.map.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                from as usize,
                (b - from) as usize,
            );
        }
        // Also drop them from the page cache: under a memory cgroup they count against us.
        fadvise_dontneed(self.file.as_raw_fd(), (a, b));
    }
}

/// How far behind a released range `Source::release` also drops mapped pages.
///
/// A read fault can map more than the page it needs: the page cache pages around it
/// (fault-around) and the rest of a large folio, including pages just before the window
/// being read, which the previous release already dropped. Nothing would drop them again.
/// Measured: converting a 4 GiB input right after the bare mmap loop had read it (and a
/// `cat` had brought it back into the cache) left 59-60 MiB peak RSS instead of 41 MiB, in
/// 3 of 3 runs; a 64 KiB reach-back gave 56 MiB, this one 41 MiB. One fault maps pages of
/// one page table only, i.e. inside the 2 MiB-aligned span around it, so reaching 2 MiB
/// back covers all of them; zapping page-table entries that are already empty costs next
/// to nothing.
const FAULT_AROUND_MAX: u64 = 2 << 20;

/// Drop a file range from the page cache (advisory).
pub fn fadvise_dontneed(fd: i32, (a, b): (u64, u64)) {
    // SAFETY: advisory call on our own descriptor; it cannot touch memory we hold.
    unsafe {
        libc::posix_fadvise(fd, a as i64, (b - a) as i64, libc::POSIX_FADV_DONTNEED);
    }
}
