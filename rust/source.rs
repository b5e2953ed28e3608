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

use crate::error::{Error, Result, Warning};
use crate::format::Format;
use crate::gather::{Gather, PiecesError};
use crate::header::{SourceHeader, SourceTensor};
use crate::text::{count, name_list};
use crate::vocab::WarningKind;

/// One mapped input file: its path, the open file, a read-only map of exactly the size
/// `fstat` gave, and that size and mtime (to see a change while it is read).
pub struct InputFile {
    pub path: PathBuf,
    pub file: File,
    pub map: Mmap,
    /// Where the offsets of this file's tensors count from: its data section (safetensors),
    /// or 0 where they are absolute (PyTorch checkpoints).
    pub base: u64,
    stamp: Stamp,
}

/// An opened, validated input: one or more mapped files and the tensors they hold.
///
/// A safetensors file is one file and its header. Other formats (PyTorch checkpoints) and
/// composites (the files an output shard reads from) fill the same header with tensors
/// that name their file (`SourceTensor::input`) and, for views that are not one
/// little-endian run or tensors in pieces across files, how to gather them
/// (`SourceTensor::gather`).
pub struct Source {
    /// What the input is called in messages: the file, or for a composite the first one.
    pub path: PathBuf,
    pub files: Vec<InputFile>,
    pub header: SourceHeader,
    /// For a PyTorch checkpoint: its format, the dict selected, what was left out.
    pub origin: Option<Origin>,
    /// The checkpoint folders it was read from (a DCP or ZeRO folder): every file and
    /// folder in them is the source's, which no output may replace or lie in.
    pub folders: Vec<PathBuf>,
    /// The prefixes to strip from tensor names that no name started with (a warning).
    pub unused_prefixes: Vec<String>,
    /// The sizes fused MoE experts were split by (`experts::split`), if any was.
    pub experts: Option<[u64; 2]>,
    /// Each piece of a fused MoE expert tensor split (`experts::split`): its name -> the
    /// fused tensor's.
    pub pieces: std::collections::HashMap<String, String>,
    /// The fused MoE expert tensors among them split from the transposed layout (a note).
    pub transposed: Vec<String>,
}

/// What a source read from a PyTorch checkpoint says beyond its tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// `Format::TorchZip` or `Format::TorchLegacy`, or a distributed checkpoint's format.
    pub format: Format,
    /// The dotted key of the dict converted (`""`: the top level).
    pub key: String,
    /// Entries of that dict (and the dicts below it) that are not tensors: left out.
    pub skipped: Vec<String>,
    /// Every global the pickle names (`module.name`), in order of first appearance.
    pub globals: Vec<String>,
    /// Those outside the allow-list: inert placeholders, never imported or called.
    pub unlisted: Vec<String>,
}

impl Origin {
    /// What the caller should hear: the entries left out, the globals not called.
    pub fn warnings(&self) -> Vec<Warning> {
        let mut out = Vec::new();
        if !self.skipped.is_empty() {
            let within = if self.key.is_empty() {
                String::new()
            } else {
                format!(" of `{}`", crate::text::esc(&self.key))
            };
            let text = match self.skipped.as_slice() {
                [one] => format!(
                    "entry `{}`{within} is not a tensor and is left out",
                    crate::text::esc(one)
                ),
                many => format!(
                    "{} entries{within} are not tensors and are left out: {}",
                    many.len(),
                    name_list(many.iter().map(String::as_str), 8)
                ),
            };
            out.push(Warning::new(WarningKind::SkippedEntries, text));
        }
        if !self.unlisted.is_empty() {
            out.push(Warning::new(
                WarningKind::UnlistedGlobals,
                format!(
                    "the pickle names {} outside the allow-list, none of them called (they \
                     build no tensor that is converted): {}",
                    count(self.unlisted.len() as u64, "global"),
                    name_list(self.unlisted.iter().map(String::as_str), 8)
                ),
            ));
        }
        out
    }
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

impl InputFile {
    /// Open and map `path` (a regular file of at least `min_len` bytes; a smaller one is
    /// `too_small(size)`, never mapped: pseudo-files of /proc report 0 bytes and then
    /// yield any amount).
    pub fn open(path: &Path, min_len: u64, too_small: impl Fn(u64) -> Error) -> Result<InputFile> {
        let (file, meta) = open_regular(path)?;
        if meta.len() < min_len.max(1) {
            return Err(too_small(meta.len()));
        }
        // SAFETY: the map is read-only. Another process truncating the file while we run
        // would fault (SIGBUS); that is the usual contract of reading through mmap. Readers
        // check the size before each window (`check_unchanged`), which narrows this to a
        // truncation during the read of one window.
        let map =
            unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "cannot map the input", e))?;
        Ok(InputFile {
            path: path.to_path_buf(),
            file,
            map,
            base: 0,
            stamp: Stamp::of(&meta),
        })
    }

    /// Another handle on the same open file (the same inode, whatever its name is now),
    /// mapped again, with the size and mtime taken when it was first opened: a change since
    /// then is refused here and seen by every later check. For passes that read a file
    /// long after it was opened and validated (one output shard after another).
    pub fn duplicate(&self) -> Result<InputFile> {
        // Before mapping: a truncated file would be mapped short of its tensors.
        self.check_unchanged()?;
        let file = self
            .file
            .try_clone()
            .map_err(|e| Error::io(&self.path, "cannot open the input", e))?;
        // SAFETY: as in `open`: a read-only map of a file checked just now to be the size
        // it had when validated.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::io(&self.path, "cannot map the input", e))?;
        Ok(InputFile {
            path: self.path.clone(),
            file,
            map,
            base: self.base,
            stamp: self.stamp,
        })
    }

    /// Drop the pages reading the first `len` bytes mapped: the header, and what
    /// fault-around and large folios mapped around it (see `FAULT_AROUND_MAX`). For a file
    /// held open while others are read: nothing else would ever drop them.
    pub fn release_head(&self, len: u64) {
        let end = len.saturating_add(FAULT_AROUND_MAX);
        self.release((0, end.min(self.map.len() as u64)));
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

    /// Unmap the pages of an absolute byte range, leaving them in the page cache: a later
    /// read of them is a minor fault, not I/O. For views read out of order (a transposed
    /// tensor reads across its whole storage in every window), so that only one window's
    /// pages are mapped at a time.
    pub fn unmap(&self, (a, b): (u64, u64)) {
        // SAFETY: the map is read-only and shared; dropping its pages only means a later
        // read faults them in again from the file. The caller holds no reference into the
        // range (a gathered window was copied out).
        unsafe {
            let _ = self.map.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                a as usize,
                b.saturating_sub(a) as usize,
            );
        }
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

/// Input pages read and not yet released, gathered into contiguous runs of about a window,
/// so that many small reads (tensors of a few KiB) cost one release call (convert, verify).
#[derive(Debug, Default)]
pub struct PendingRelease(Option<(usize, u64, u64)>);

impl PendingRelease {
    /// `[a, b)` of `files[i]` is read: release it with its contiguous neighbours once they
    /// make `window` bytes (a run that does not follow on is released first).
    pub fn add(&mut self, files: &[InputFile], i: usize, (a, b): (u64, u64), window: u64) {
        self.0 = match self.0 {
            Some((f, x, y)) if f == i && y == a => Some((f, x, b)),
            Some((f, x, y)) => {
                files[f].release((x, y));
                Some((i, a, b))
            }
            None => Some((i, a, b)),
        };
        if let Some((f, x, y)) = self.0 {
            if y - x >= window {
                files[f].release((x, y));
                self.0 = None;
            }
        }
    }

    /// Release what is pending.
    pub fn flush(&mut self, files: &[InputFile]) {
        if let Some((f, x, y)) = self.0.take() {
            files[f].release((x, y));
        }
    }
}

/// What `read_header` tells of a safetensors file: `(header_len, sha256, metadata,
/// tensors)`. `header_len` is the JSON's length (the data start at `8 + header_len`),
/// `sha256` the hex SHA-256 of the length prefix and the header, `metadata` the
/// `__metadata__` pairs in file order (or None), `tensors` each `(name, dtype, shape,
/// start, end)` in data order, offsets relative to the data section.
pub type HeaderSummary = (
    u64,
    String,
    Option<Vec<(String, String)>>,
    Vec<(String, String, Vec<usize>, u64, u64)>,
);

/// The header of the safetensors file `path`, read and validated (`Source::open`); a file
/// that is no valid safetensors file is `InvalidHeader`.
pub fn read_header(path: &Path) -> Result<HeaderSummary> {
    let source = Source::open(path)?;
    let header = &source.header;
    let end = usize::try_from(header.data_start()).unwrap_or(usize::MAX);
    let sha256 = crate::text::sha256_hex(&source.primary().map[..end]);
    let tensors = header
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dtype.to_string(),
                t.shape.clone(),
                t.start,
                t.end,
            )
        })
        .collect();
    Ok((header.header_len, sha256, header.metadata.clone(), tensors))
}

impl Source {
    /// A source from files already opened and the tensors they hold (other formats,
    /// composites). `path` names it in messages.
    pub fn from_parts(path: &Path, files: Vec<InputFile>, header: SourceHeader) -> Source {
        Source {
            path: path.to_path_buf(),
            files,
            header,
            origin: None,
            folders: Vec::new(),
            unused_prefixes: Vec::new(),
            experts: None,
            pieces: Default::default(),
            transposed: Vec::new(),
        }
    }

    /// The first file (the only one of a safetensors source).
    pub fn primary(&self) -> &InputFile {
        &self.files[0]
    }

    /// Device and inode of the first file.
    pub fn identity(&self) -> Result<(u64, u64)> {
        self.primary().identity()
    }

    /// Device and inode of every file.
    pub fn identities(&self) -> Result<Vec<(u64, u64)>> {
        self.files.iter().map(InputFile::identity).collect()
    }

    /// Fail if any file changed since it was opened (see `InputFile::check_unchanged`).
    pub fn check_unchanged(&self) -> Result<()> {
        self.files.iter().try_for_each(InputFile::check_unchanged)
    }

    /// Bytes of every file.
    pub fn file_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.map.len() as u64).sum()
    }

    /// Read-ahead advice for every map.
    pub fn advise(&self, advice: memmap2::Advice) {
        for f in &self.files {
            let _ = f.map.advise(advice);
        }
    }

    /// Drop the pages of every byte a gathered tensor's elements lie in (once it is read
    /// whole: a view's elements, or a piece's, lie anywhere in their span). Nothing for a
    /// tensor that is one run.
    pub fn release_gathered(&self, t: &SourceTensor) {
        if let Some(g) = &t.gather {
            for (i, span) in g.spans(t.input) {
                self.files[i].release((span.start, span.end));
            }
        }
    }

    /// The file and absolute byte offset of tensor `t`'s first byte (for a gathered tensor,
    /// of where its elements begin).
    pub fn locate(&self, t: &SourceTensor) -> (&InputFile, u64) {
        let f = &self.files[t.input];
        (f, f.base + t.start)
    }

    /// Bytes `pos..pos + len` of tensor `t` written contiguously: a slice of its file's map,
    /// or for a gathered view its elements copied into `scratch` (bounded: the caller asks
    /// a window at a time). `pos` and `len` are whole elements.
    pub fn read<'a>(
        &'a self,
        t: &SourceTensor,
        pos: u64,
        len: u64,
        scratch: &'a mut Vec<u8>,
    ) -> Result<&'a [u8]> {
        let (f, at) = self.locate(t);
        match &t.gather {
            None => {
                let a = (at + pos) as usize;
                Ok(&f.map[a..a + len as usize])
            }
            Some(g) => {
                if scratch.len() < len as usize {
                    scratch.resize(len as usize, 0);
                }
                let out = &mut scratch[..len as usize];
                let desc = match &**g {
                    Gather::View(desc) => desc,
                    Gather::Pieces(p) => {
                        let first = pos / p.elem_size();
                        // Before their pages are read: a file truncated since it was
                        // opened is reported, not faulted on.
                        // (A file the source lacks is `gather`'s to refuse.)
                        for q in p.touching(first, len / p.elem_size()) {
                            if let Some(f) = self.files.get(q.input) {
                                f.check_unchanged()?;
                            }
                        }
                        let maps: Vec<&[u8]> = self.files.iter().map(|f| &f.map[..]).collect();
                        // As a view's blocks: each piece's pages are unmapped once copied out.
                        p.gather(&maps, first, out, &mut |i, r| {
                            self.files[i].unmap((r.start, r.end))
                        })
                        .map_err(|problem| {
                            let e = PiecesError {
                                tensor: t.name.clone(),
                                problem,
                            };
                            Error::invalid_header(&self.path, e.to_string())
                        })?;
                        return Ok(out);
                    }
                };
                let first = pos / desc.elem_size().max(1);
                // A strided view reads a page of many rows of its storage: each block's
                // pages are unmapped once it is copied out, or the whole storage ends up
                // resident (they stay cached: the next window's faults are minor).
                crate::torch::gather_releasing(&f.map, desc, first, out, &mut |r| {
                    f.unmap((r.start, r.end))
                })
                .map_err(|e| Error::invalid_header(&f.path, e.to_string()))?;
                let span = desc.span();
                f.unmap((span.start, span.end));
                Ok(out)
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{file, folder_of};
    use crate::vocab::ErrorKind;

    #[test]
    fn a_header_is_told_by_its_length_hash_metadata_and_tensors_in_data_order() {
        let header = r#"{"b":{"dtype":"F32","shape":[2,3],"data_offsets":[8,32]},"__metadata__":{"z":"1","format":"pt"},"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}"#;
        let bytes = file(header, 32);
        let files = [
            ("m.safetensors", bytes.clone()),
            ("notes.bin", vec![0xff; 64]),
        ];
        let dir = folder_of("source-read-header", &files);
        let (len, sha256, metadata, tensors) = read_header(&dir.join("m.safetensors")).unwrap();
        assert_eq!(len, header.len() as u64);
        // (What a manifest keeps: the hash of the length prefix and the header, as written.)
        assert_eq!(sha256, crate::text::sha256_hex(&bytes[..8 + header.len()]));
        let pairs = [("z", "1"), ("format", "pt")];
        let pairs = pairs.map(|(k, v)| (k.to_string(), v.to_string()));
        assert_eq!(metadata, Some(pairs.to_vec()));
        let want = [("a", "F16", vec![4], 0, 8), ("b", "F32", vec![2, 3], 8, 32)];
        let want = want.map(|(n, d, s, a, b)| (n.to_string(), d.to_string(), s, a, b));
        assert_eq!(tensors, want.to_vec());
        let e = read_header(&dir.join("notes.bin")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
}
