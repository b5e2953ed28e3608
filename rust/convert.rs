//! The streaming job: map the input, plan, convert window by window into the mapped
//! output, release pages behind us, publish.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use memmap2::{Advice, Mmap, MmapMut, UncheckedAdvice};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::failpoint;
use crate::header::{
    self, Action, Conversion, Plan, PlanOptions, SourceHeader, Target, Unmatched, PREFIX,
};
use crate::kernels::{self, Isa};
use crate::numerics::{self, Numerics};
use crate::output::{self, TempOutput};
use crate::scan::{self, OnOverflow};

/// Input bytes converted per window. Memory in use is a small multiple of this.
pub const DEFAULT_WINDOW: usize = 8 << 20;
/// Windows smaller than this run on one thread: waking the pool costs more.
const PARALLEL_MIN: usize = 512 << 10;

/// How to convert.
#[derive(Clone, Debug)]
pub struct Options {
    pub target: Target,
    /// Worker threads; 0 means one per available core.
    pub threads: usize,
    /// Replace an existing destination.
    pub force: bool,
    /// Input bytes per window (rounded down to a multiple of 64, at least 64 KiB).
    pub window: usize,
    /// Kernel family; `None` picks the best this CPU supports.
    pub isa: Option<Isa>,
    /// Fault each window in with one call (`MADV_POPULATE_*`) instead of page by page.
    pub populate: bool,
    /// Read-ahead advice for the input mapping.
    pub advise: ReadAdvice,
    /// Output ranges whose writeback may be in flight before the oldest is waited for and
    /// dropped (at least 1). Each is about half a window (bf16) of dirty pages.
    pub write_behind_depth: usize,
    /// fnmatch patterns of float tensors that keep their dtype (`PlanOptions::keep`).
    pub keep: Vec<String>,
    /// Float tensors with fewer elements keep their dtype.
    pub keep_min_size: u64,
    /// Under F16, convert BF16 tensors too.
    pub from_bf16: bool,
    /// What a `keep` pattern matching no tensor does (`Error` under `--strict`).
    pub unmatched: Unmatched,
    /// Tensors kept to avoid overflow (the `OnOverflow::Keep` scan fills this).
    pub keep_names: std::collections::HashSet<String>,
    pub on_overflow: OnOverflow,
    /// Measure each converted tensor as it is written (`Report::numerics`).
    pub numerics: bool,
}

impl Options {
    /// The part of the options that decides the plan.
    pub fn plan_options(&self) -> PlanOptions {
        PlanOptions {
            target: self.target,
            keep: self.keep.clone(),
            keep_min_size: self.keep_min_size,
            from_bf16: self.from_bf16,
            keep_names: self.keep_names.clone(),
            unmatched: self.unmatched,
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            target: Target::Bf16,
            threads: 0,
            force: false,
            window: DEFAULT_WINDOW,
            isa: None,
            // STCAST_POPULATE=0, STCAST_ADVISE=none|sequential|willneed and
            // STCAST_WRITE_BEHIND=N change these for the A/B measurements behind the
            // defaults (benches/knobs.py); they are not an interface.
            populate: std::env::var("STCAST_POPULATE").map_or(true, |v| v != "0"),
            advise: std::env::var("STCAST_ADVISE")
                .ok()
                .and_then(|v| ReadAdvice::parse(&v))
                .unwrap_or(ReadAdvice::Sequential),
            write_behind_depth: std::env::var("STCAST_WRITE_BEHIND")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .map_or(1, |d| d.clamp(1, 64)),
            keep: Vec::new(),
            keep_min_size: 0,
            from_bf16: false,
            unmatched: Unmatched::Warn,
            keep_names: Default::default(),
            on_overflow: OnOverflow::Warn,
            numerics: true,
        }
    }
}

/// Read-ahead advice for the input mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadAdvice {
    /// None: the kernel's default read-ahead.
    Normal,
    /// `MADV_SEQUENTIAL` over the whole mapping (the default).
    Sequential,
    /// `MADV_SEQUENTIAL`, and `MADV_WILLNEED` on the next window before converting this one.
    WillNeed,
}

impl ReadAdvice {
    fn parse(s: &str) -> Option<ReadAdvice> {
        match s {
            "none" | "normal" => Some(ReadAdvice::Normal),
            "sequential" => Some(ReadAdvice::Sequential),
            "willneed" => Some(ReadAdvice::WillNeed),
            _ => None,
        }
    }
}

/// What a finished conversion did.
#[derive(Clone, Debug)]
pub struct Report {
    pub src: PathBuf,
    pub dst: PathBuf,
    pub target: Target,
    pub tensors_converted: usize,
    /// Tensors copied, the kept ones included.
    pub tensors_copied: usize,
    /// Float tensors kept in their source dtype (by pattern, size or overflow), and their bytes.
    pub tensors_kept: usize,
    pub bytes_kept: u64,
    /// Those tensors, in output order.
    pub kept: Vec<header::KeptTensor>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub seconds: f64,
    pub threads: usize,
    pub isa: Isa,
    pub warnings: Vec<String>,
    /// What rounding did to each converted tensor, in output order (empty without
    /// `Options::numerics`), and to all of them.
    pub numerics: Vec<(String, Numerics)>,
    pub numerics_total: Numerics,
}

/// An opened, validated input: its file, its bytes and its header.
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

impl Source {
    /// Open and validate `path` without blocking on FIFOs and without reading data.
    pub fn open(path: &Path) -> Result<Source> {
        // O_NONBLOCK: opening a FIFO for reading must not wait for a writer.
        let mut file = OpenOptions::new()
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
            return Err(Error::refused(
                path,
                format!("input is {what}, not a regular file"),
            ));
        }
        if meta.len() < PREFIX as u64 {
            // Too small to map usefully; let the header reader give the usual reason.
            let mut small = Vec::new();
            file.read_to_end(&mut small)
                .map_err(|e| Error::io(path, "cannot read the input", e))?;
            return Err(header::read_header(path, &small).err().unwrap_or_else(|| {
                Error::invalid(path, "invalid safetensors file: header too small")
            }));
        }
        // SAFETY: the map is read-only. Another process truncating the file while we run
        // would fault (SIGBUS); that is the usual contract of reading through mmap. `Job`
        // checks the size before each window (`check_unchanged`), which narrows this to a
        // truncation during the read of one window.
        let map =
            unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "cannot map the input", e))?;
        let header = header::read_header(path, &map)?;
        Ok(Source {
            path: path.to_path_buf(),
            file,
            map,
            header,
            stamp: Stamp::of(&meta),
        })
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
        let what = if now.0 != self.stamp.0 {
            format!("its size went from {} to {} bytes", self.stamp.0, now.0)
        } else {
            "it was modified".to_string()
        };
        Err(Error::invalid(
            &self.path,
            format!("input changed while being read ({what}); no output was written"),
        ))
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

impl Source {
    /// Drop the pages of an absolute byte range that we are done with, and any mapped
    /// again behind it by fault-around (see `FAULT_AROUND_MAX`).
    pub(crate) fn release(&self, (a, b): (u64, u64)) {
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

/// Plan the conversion of `path` without writing anything.
pub fn inspect(path: &Path, opts: &PlanOptions) -> Result<(Source, Plan)> {
    let src = Source::open(path)?;
    let plan = header::plan(path, &src.header, opts)?;
    Ok((src, plan))
}

/// Refuse a destination that cannot be written: a missing folder, the input itself, a
/// folder, an existing file without `force`. Returns the mode of the file `force` replaces.
pub fn check_destination(src: &Source, dst: &Path, force: bool) -> Result<Option<u32>> {
    let dir = output::parent_dir(dst);
    match std::fs::metadata(&dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(Error::refused(&dir, "destination folder is not a folder")),
        Err(_) => return Err(Error::refused(&dir, "destination folder does not exist")),
    }
    let src_meta = src
        .file
        .metadata()
        .map_err(|e| Error::io(&src.path, "cannot stat the input", e))?;
    let mut replaced_mode = None;
    if let Some((dev, ino, mode)) = output::identity(dst) {
        if (dev, ino) == (src_meta.dev(), src_meta.ino()) {
            return Err(Error::refused(dst, "destination is the input file"));
        }
        if mode & libc::S_IFMT == libc::S_IFDIR {
            return Err(Error::refused(dst, "destination is a folder"));
        }
        if !force {
            return Err(output::exists_error(dst));
        }
        replaced_mode = Some(mode);
    }
    Ok(replaced_mode)
}

/// A conversion in progress. Dropping it before `finish` leaves nothing behind.
pub struct Job {
    src: Source,
    dst: PathBuf,
    plan: Plan,
    out: TempOutput,
    out_map: MmapMut,
    pool: rayon::ThreadPool,
    threads: usize,
    isa: Isa,
    window: usize,
    populate: bool,
    advise: ReadAdvice,
    write_behind_depth: usize,
    /// Next tensor (index into `plan.tensors`) and the source bytes of it already done.
    next: usize,
    pos: u64,
    done: u64,
    total: u64,
    /// Input pages read but not yet released: an absolute file range.
    in_pending: Option<(u64, u64)>,
    /// Output written since the last writeback start: an absolute file range.
    out_pending: Option<(u64, u64)>,
    /// Output whose writeback was started and that is dropped once written, oldest first.
    out_inflight: std::collections::VecDeque<(u64, u64)>,
    mid_tensor_hit: bool,
    on_overflow: OnOverflow,
    started: Instant,
    /// Per tensor of `plan.tensors`, when measuring.
    numerics: Option<Vec<Numerics>>,
}

impl Job {
    /// Validate everything, refuse what must be refused, and create the hidden output.
    ///
    /// `OnOverflow::Keep` needs a scan first: see `scan::overflow_scan` and `scan::keep_job`
    /// (or `convert`, which does both); here it plans with `opts.keep_names` as given.
    pub fn open(src_path: &Path, dst: &Path, opts: &Options) -> Result<Job> {
        Job::with_source(Source::open(src_path)?, dst, opts)
    }

    /// `open` with the input already opened (and maybe scanned: its stamp is still the one
    /// taken when it was opened, so a change during the scan is caught too).
    pub fn with_source(src: Source, dst: &Path, opts: &Options) -> Result<Job> {
        let started = Instant::now();
        let src_path = src.path.clone();
        let src_path = src_path.as_path();
        let dir = output::parent_dir(dst);
        let replaced_mode = check_destination(&src, dst, opts.force)?;
        let mut plan = header::plan(src_path, &src.header, &opts.plan_options())?;
        // Temp files of killed runs (named ones, where O_TMPFILE is missing) go first.
        plan.warnings.extend(output::remove_stale_temps(&dir));

        let out = TempOutput::create(dst, opts.force, replaced_mode)?;
        out.preallocate(plan.file_len())?;
        // SAFETY: the file is ours alone (unnamed, or named and locked), and sized to
        // the plan by `preallocate`; nothing else resizes it while mapped.
        let mut out_map = unsafe { MmapMut::map_mut(&out.file) }
            .map_err(|e| Error::io(dst, "cannot map the output", e))?;
        out_map[..plan.header.len()].copy_from_slice(&plan.header);
        if opts.advise != ReadAdvice::Normal {
            let _ = src.map.advise(Advice::Sequential);
        }

        let (pool, threads) = worker_pool(opts.threads, "stcast", dst)?;
        let total = src.header.data_len();
        let plan_len = plan.tensors.len();
        Ok(Job {
            dst: dst.to_path_buf(),
            plan,
            out,
            out_map,
            pool,
            threads,
            isa: opts.isa.unwrap_or_else(Isa::detect),
            window: (opts.window.max(64 << 10)) & !63,
            populate: opts.populate,
            advise: opts.advise,
            write_behind_depth: opts.write_behind_depth.max(1),
            next: 0,
            pos: 0,
            done: 0,
            total,
            in_pending: None,
            out_pending: None,
            out_inflight: Default::default(),
            mid_tensor_hit: false,
            on_overflow: opts.on_overflow,
            started,
            // The overflow guard needs the counts whatever `opts.numerics` says.
            numerics: (opts.numerics || opts.on_overflow == OnOverflow::Error)
                .then(|| vec![Numerics::default(); plan_len]),
            src,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn source(&self) -> &SourceHeader {
        &self.src.header
    }

    /// Source data bytes done and in all.
    pub fn progress(&self) -> (u64, u64) {
        (self.done, self.total)
    }

    /// What rounding did so far to each tensor of `plan().tensors` (None without
    /// `Options::numerics`): complete for all of them once `step` returned true.
    pub fn numerics(&self) -> Option<&[Numerics]> {
        self.numerics.as_deref()
    }

    /// Convert about `budget` source bytes (whole windows). Returns true when all is done.
    pub fn step(&mut self, budget: u64) -> Result<bool> {
        let mut spent = 0u64;
        while spent < budget && self.next < self.plan.tensors.len() {
            let t = &self.plan.tensors[self.next];
            let s = &self.src.header.tensors[t.source];
            let len = s.len();
            if self.pos >= len {
                self.next += 1;
                self.pos = 0;
                continue;
            }
            let action = t.action;
            let (src_size, dst_size) = match action {
                Action::Copy => (1, 1),
                Action::Convert(c) => (c.src_size(), 2),
            };
            let n = (self.window as u64).min(len - self.pos);
            let src_abs = self.src.header.data_start() + s.start + self.pos;
            let dst_abs = self.plan.data_start() + t.start + self.pos / src_size * dst_size;
            let dst_n = n / src_size * dst_size;
            let (sa, da) = (src_abs as usize, dst_abs as usize);
            self.src.check_unchanged()?;
            if self.advise == ReadAdvice::WillNeed {
                // Start reading the next window while this one converts.
                let end = (sa + 2 * n as usize).min(self.src.map.len());
                if sa + (n as usize) < end {
                    let _ = self.src.map.advise_range(
                        Advice::WillNeed,
                        sa + n as usize,
                        end - sa - n as usize,
                    );
                }
            }
            let src_bytes = &self.src.map[sa..sa + n as usize];
            let dst_bytes = &mut self.out_map[da..da + dst_n as usize];
            let work = Work {
                pool: &self.pool,
                threads: self.threads,
                isa: self.isa,
                populate: self.populate,
            };
            let faulted = match (action, &mut self.numerics) {
                (Action::Convert(c), Some(all)) => {
                    let (measured, faulted) = work.convert_and_measure(c, src_bytes, dst_bytes);
                    all[self.next].merge(&measured);
                    faulted
                }
                _ => work.run(action, src_bytes, dst_bytes),
            };
            if faulted {
                // Pages past the end of a file truncated just now: say so rather than fault.
                self.src.check_unchanged()?;
                return Err(Error::io(
                    &self.src.path,
                    "cannot read the input",
                    std::io::Error::from_raw_os_error(libc::EFAULT),
                ));
            }

            self.pos += n;
            self.done += n;
            spent += n;
            self.release_input(src_abs, n);
            self.note_output(dst_abs, dst_n)?;
            if self.pos < len && !self.mid_tensor_hit {
                self.mid_tensor_hit = true;
                failpoint::hit("mid-tensor")
                    .map_err(|e| Error::io(&self.dst, "conversion failed", e))?;
            }
        }
        let finished = self.next >= self.plan.tensors.len();
        if finished {
            self.flush_pages()?;
        }
        Ok(finished)
    }

    /// Drop input pages that are done with, in contiguous batches of about a window.
    fn release_input(&mut self, at: u64, n: u64) {
        match self.in_pending {
            Some((a, b)) if b == at => self.in_pending = Some((a, b + n)),
            Some(r) => {
                self.src.release(r);
                self.in_pending = Some((at, at + n));
            }
            None => self.in_pending = Some((at, at + n)),
        }
        if let Some(r @ (a, b)) = self.in_pending {
            if b - a >= self.window as u64 {
                self.src.release(r);
                self.in_pending = None;
            }
        }
    }

    /// Start writeback of finished output and drop the window written before it.
    fn note_output(&mut self, at: u64, n: u64) -> Result<()> {
        let (a, b) = match self.out_pending {
            Some((a, b)) if b == at => (a, b + n),
            Some(r) => {
                self.write_behind(r)?;
                (at, at + n)
            }
            None => (at, at + n),
        };
        self.out_pending = Some((a, b));
        // Output windows are half the input ones for bf16; batch them to a window.
        if b - a >= self.window as u64 / 2 {
            self.out_pending = None;
            self.write_behind((a, b))?;
        }
        Ok(())
    }

    /// Start writing `r` back, then wait for the oldest range beyond `write_behind_depth`
    /// (by default the previous one) and drop its pages, so dirty and resident memory stay
    /// at a few windows whatever the file size.
    fn write_behind(&mut self, r: (u64, u64)) -> Result<()> {
        let fd = self.out.file.as_raw_fd();
        // Starting writeback is advisory; a real write error surfaces in `settle` or fsync.
        let _ = sync_range(fd, r, libc::SYNC_FILE_RANGE_WRITE);
        self.out_inflight.push_back(r);
        while self.out_inflight.len() > self.write_behind_depth {
            let oldest = self.out_inflight.pop_front().expect("non-empty");
            self.settle(oldest)?;
        }
        Ok(())
    }

    fn settle(&mut self, r: (u64, u64)) -> Result<()> {
        let fd = self.out.file.as_raw_fd();
        let rc = sync_range(
            fd,
            r,
            libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER,
        );
        if let Err(e) = rc {
            // EIO here is a real write error: stop rather than publish a bad file.
            if e.raw_os_error() == Some(libc::EIO) {
                return Err(Error::io(&self.dst, "write failed", e));
            }
        }
        // SAFETY: MADV_DONTNEED on a shared file mapping only drops our page-table
        // entries; the data stays in the page cache and file, and a later touch of the
        // same pages re-reads it. No Rust reference into this range is alive.
        unsafe {
            let _ = self.out_map.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                r.0 as usize,
                (r.1 - r.0) as usize,
            );
        }
        fadvise_dontneed(fd, r);
        Ok(())
    }

    fn flush_pages(&mut self) -> Result<()> {
        if let Some(r) = self.in_pending.take() {
            self.src.release(r);
        }
        if let Some(r) = self.out_pending.take() {
            self.write_behind(r)?;
        }
        while let Some(r) = self.out_inflight.pop_front() {
            self.settle(r)?;
        }
        Ok(())
    }

    /// Make the output durable and give it its name.
    pub fn finish(self) -> Result<Report> {
        let Job {
            src,
            dst,
            out,
            out_map,
            threads,
            isa,
            started,
            numerics,
            on_overflow,
            mut plan,
            ..
        } = self;
        drop(out_map);
        // Everything is read: an input unchanged now was unchanged while it was read.
        src.check_unchanged()?;
        let numerics: Vec<(String, Numerics)> = plan
            .tensors
            .iter()
            .zip(numerics.unwrap_or_default())
            .filter(|(t, _)| matches!(t.action, Action::Convert(_)))
            .map(|(t, n)| (src.header.tensors[t.source].name.clone(), n))
            .collect();
        // Dropping `out` unpublished leaves nothing behind.
        if let Some(overflow) = scan::Overflow::find(&numerics, plan.target) {
            if on_overflow == OnOverflow::Error {
                return Err(overflow.error(&src.path));
            }
            plan.warnings.push(overflow.warning());
        }
        out.publish()?;
        let copied = plan.tensors.len() - plan.converted();
        Ok(Report {
            numerics_total: Numerics::total(numerics.iter().map(|(_, n)| n)),
            numerics,
            tensors_kept: plan.kept(),
            bytes_kept: plan.kept_bytes(),
            kept: plan.kept_tensors(&src.header),
            bytes_in: src.map.len() as u64,
            bytes_out: plan.file_len(),
            src: src.path,
            dst,
            target: plan.target,
            tensors_converted: plan.converted(),
            tensors_copied: copied,
            seconds: started.elapsed().as_secs_f64(),
            threads,
            isa,
            warnings: plan.warnings,
        })
    }
}

/// Convert `src` to `dst` in one call (for Rust users and tests; Python steps the job).
pub fn convert(src: &Path, dst: &Path, opts: &Options) -> Result<Report> {
    let mut job = if opts.on_overflow == OnOverflow::Keep {
        let mut scan = scan::overflow_scan(src, dst, opts)?;
        while !scan.step(u64::MAX)? {}
        scan::keep_job(scan, dst, opts)?
    } else {
        Job::open(src, dst, opts)?
    };
    while !job.step(u64::MAX)? {}
    job.finish()
}

/// A pool of `threads` workers (0: one per available core) and its size; `path` is named
/// in the error if the threads cannot be started.
pub(crate) fn worker_pool(
    threads: usize,
    name: &'static str,
    path: &Path,
) -> Result<(rayon::ThreadPool, usize)> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("{name}-{i}"))
        .build()
        .map_err(|e| {
            Error::io(
                path,
                "cannot start worker threads",
                std::io::Error::other(e),
            )
        })?;
    Ok((pool, threads))
}

/// How a window's work is done: which pool, how many threads, which kernels.
pub(crate) struct Work<'a> {
    pub pool: &'a rayon::ThreadPool,
    pub threads: usize,
    pub isa: Isa,
    /// Fault each thread's share in with one call (`MADV_POPULATE_*`) before touching it.
    pub populate: bool,
}

impl Work<'_> {
    /// Split `src`/`dst` into one chunk per thread (elements of `src_size`/`dst_size`
    /// bytes) and run `f` on each; returns true if populating the input hit EFAULT (the
    /// file shrank), in which case that chunk was skipped.
    fn split<R: Send + Default>(
        &self,
        src: &[u8],
        dst: &mut [u8],
        (src_size, dst_size): (usize, usize),
        f: impl Fn(&[u8], &mut [u8]) -> R + Sync,
        merge: impl Fn(R, R) -> R + Sync + Send,
    ) -> (R, bool) {
        let faulted = std::sync::atomic::AtomicBool::new(false);
        // Each thread faults its own share in: batched like one big populate call, but
        // in parallel, which matters where faults cost more than the conversion.
        let chunk = |s: &[u8], d: &mut [u8]| {
            if self.populate {
                if prefault(s, libc::MADV_POPULATE_READ) == Some(libc::EFAULT) {
                    faulted.store(true, std::sync::atomic::Ordering::Relaxed);
                    return R::default();
                }
                prefault(d, libc::MADV_POPULATE_WRITE);
            }
            f(s, d)
        };
        let r = if self.threads <= 1 || src.len() < PARALLEL_MIN {
            chunk(src, dst)
        } else {
            let per = (src.len() / src_size)
                .div_ceil(self.threads)
                .next_multiple_of(1024);
            self.pool.install(|| {
                src.par_chunks(per * src_size)
                    .zip(dst.par_chunks_mut(per * dst_size))
                    .map(|(s, d)| chunk(s, d))
                    .reduce(R::default, &merge)
            })
        };
        (r, faulted.into_inner())
    }

    /// Copy or convert one window.
    pub(crate) fn run(&self, action: Action, src: &[u8], dst: &mut [u8]) -> bool {
        let sizes = match action {
            Action::Copy => (1, 1),
            Action::Convert(c) => (c.src_size() as usize, 2),
        };
        let isa = self.isa;
        self.split(
            src,
            dst,
            sizes,
            |s, d| apply(isa, action, s, d),
            |(), ()| (),
        )
        .1
    }

    /// `run` for a conversion, measuring what it does as it goes: each thread converts
    /// and measures piece by piece, so the measure reads what the kernel just wrote from
    /// cache.
    pub(crate) fn convert_and_measure(
        &self,
        conv: Conversion,
        src: &[u8],
        dst: &mut [u8],
    ) -> (Numerics, bool) {
        /// Source bytes per piece: both sides stay in L1.
        const PIECE: usize = 16 << 10;
        let src_size = conv.src_size() as usize;
        let isa = self.isa;
        let run = |src: &[u8], dst: &mut [u8]| {
            let mut total = Numerics::default();
            for (s, d) in src.chunks(PIECE).zip(dst.chunks_mut(PIECE / src_size * 2)) {
                apply(isa, Action::Convert(conv), s, d);
                total.merge(&numerics::measure(conv, s, d));
            }
            total
        };
        let merge = |mut a: Numerics, b: Numerics| {
            a.merge(&b);
            a
        };
        self.split(src, dst, (src_size, 2), run, merge)
    }
}

/// `madvise(advice)` over the pages holding `bytes`; the errno on failure.
fn prefault(bytes: &[u8], advice: libc::c_int) -> Option<i32> {
    if bytes.is_empty() {
        return None;
    }
    let page = 4096usize;
    let start = bytes.as_ptr() as usize & !(page - 1);
    let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(page);
    // SAFETY: the range covers only pages of the mapping `bytes` lies in (maps start on a
    // page boundary and extend to one); populating changes no data and never unmaps.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
    (rc != 0).then(|| std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

fn apply(isa: Isa, action: Action, src: &[u8], dst: &mut [u8]) {
    match action {
        Action::Copy => dst.copy_from_slice(src),
        Action::Convert(Conversion::F32ToBf16) => kernels::f32_to_bf16(isa, src, dst),
        Action::Convert(Conversion::F16ToBf16) => kernels::f16_to_bf16(isa, src, dst),
        Action::Convert(Conversion::F64ToBf16) => kernels::f64_to_bf16(isa, src, dst),
        Action::Convert(Conversion::F32ToF16) => kernels::f32_to_f16(isa, src, dst),
        Action::Convert(Conversion::F64ToF16) => kernels::f64_to_f16(isa, src, dst),
        Action::Convert(Conversion::Bf16ToF16) => kernels::bf16_to_f16(isa, src, dst),
    }
}

fn fadvise_dontneed(fd: i32, (a, b): (u64, u64)) {
    // SAFETY: advisory call on our own descriptor; it cannot touch memory we hold.
    unsafe {
        libc::posix_fadvise(fd, a as i64, (b - a) as i64, libc::POSIX_FADV_DONTNEED);
    }
}

fn sync_range(fd: i32, (a, b): (u64, u64), flags: libc::c_uint) -> std::io::Result<()> {
    // SAFETY: sync_file_range on our own descriptor and a range inside the file.
    let rc = unsafe { libc::sync_file_range(fd, a as i64, (b - a) as i64, flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
