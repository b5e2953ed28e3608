//! The window cursor and the parallel split, shared by convert, scan and verify.
//!
//! Every streaming pass walks a list of byte ranges (tensors, in the order it reads them)
//! window by window: at most `window` bytes of one range at a time, so that memory in use
//! is a small multiple of the window whatever the tensor sizes. Each window is split into
//! one chunk per worker thread.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::dtype::{Action, Conversion};
use crate::error::{Error, Result};
use crate::fused;
use crate::kernels::Isa;
use crate::numerics::Numerics;

/// Input bytes per window by default. Memory in use is a small multiple of this.
pub const DEFAULT_WINDOW: usize = 8 << 20;
/// Source bytes a task converts per step, between two visits of its driver (signals,
/// progress, cancel). At the rates we reach, that is well under a second.
pub const DEFAULT_STEP: u64 = 64 << 20;
/// Windows smaller than this run on one thread: waking the pool costs more.
const PARALLEL_MIN: usize = 512 << 10;
/// The largest number of worker threads asked for that is honoured; more is refused.
pub const MAX_THREADS: usize = 1024;

/// A requested window size, rounded down to a multiple of 64 bytes, at least 64 KiB.
pub fn window_size(requested: usize) -> usize {
    requested.max(64 << 10) & !63
}

/// One window: `len` bytes of item `item`, starting `pos` bytes into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub item: usize,
    pub pos: u64,
    pub len: u64,
}

/// A walk over items of known byte lengths, one window at a time, with the bytes done.
#[derive(Clone, Debug)]
pub struct Cursor {
    window: u64,
    next: usize,
    pos: u64,
    done: u64,
    total: u64,
}

impl Cursor {
    /// A cursor over items whose lengths add up to `total`, in windows of `window` bytes.
    pub fn new(window: usize, total: u64) -> Cursor {
        Cursor {
            window: window_size(window) as u64,
            next: 0,
            pos: 0,
            done: 0,
            total,
        }
    }

    /// The next window, given each item's length (`len(i)` for `i < count`), without
    /// moving past it; None once every item is done.
    pub fn peek(&mut self, count: usize, len: impl Fn(usize) -> u64) -> Option<Window> {
        while self.next < count {
            let n = len(self.next);
            if self.pos < n {
                return Some(Window {
                    item: self.next,
                    pos: self.pos,
                    len: self.window.min(n - self.pos),
                });
            }
            self.next += 1;
            self.pos = 0;
        }
        None
    }

    /// Move past `w`, which `peek` returned and the caller has done.
    pub fn advance(&mut self, w: Window) {
        debug_assert_eq!((w.item, w.pos), (self.next, self.pos));
        self.pos += w.len;
        self.done += w.len;
    }

    /// Bytes per window.
    pub fn window(&self) -> u64 {
        self.window
    }

    /// Bytes done and in all.
    pub fn progress(&self) -> (u64, u64) {
        (self.done, self.total)
    }

    /// Move past `items` whole items from the current one (at its start), `bytes` in all:
    /// a batch of small items done at once.
    pub fn advance_items(&mut self, items: usize, bytes: u64) {
        debug_assert_eq!(self.pos, 0);
        self.next += items;
        self.done += bytes;
    }
}

/// A pool of `threads` workers (0: one per available core) and its size; `path` is named
/// in the error if the threads cannot be started.
pub fn worker_pool(
    threads: usize,
    name: &'static str,
    path: &std::path::Path,
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
pub struct Work<'a> {
    pub pool: &'a rayon::ThreadPool,
    pub threads: usize,
    pub isa: Isa,
    /// Fault each thread's share in with one call (`MADV_POPULATE_*`) before touching it.
    pub populate: bool,
}

/// Elements per thread for `elems` elements: whole multiples of `multiple` (which keeps
/// SIMD loops and blocks whole), so that every thread has about the same share.
fn per_thread(elems: usize, threads: usize, multiple: usize) -> usize {
    elems.div_ceil(threads).next_multiple_of(multiple)
}

impl Work<'_> {
    fn is_parallel(&self, bytes: usize) -> bool {
        self.threads > 1 && bytes >= PARALLEL_MIN
    }

    /// Split `src`/`dst` into one chunk per thread (elements of `src_size`/`dst_size`
    /// bytes, `multiple` elements at a time) and run `f(offset, src_chunk, dst_chunk)` on
    /// each, `offset` being the chunk's first byte in `src`. Returns the merged results and
    /// whether populating the input hit EFAULT (the file shrank), in which case that chunk
    /// was skipped.
    pub fn split<R: Send + Default>(
        &self,
        src: &[u8],
        dst: &mut [u8],
        (src_size, dst_size, multiple): (usize, usize, usize),
        f: impl Fn(usize, &[u8], &mut [u8]) -> R + Sync,
        merge: impl Fn(R, R) -> R + Sync + Send,
    ) -> (R, bool) {
        let faulted = AtomicBool::new(false);
        // Each thread faults its own share in: batched like one big populate call, but
        // in parallel, which matters where faults cost more than the conversion.
        let chunk = |offset: usize, s: &[u8], d: &mut [u8]| {
            if self.populate {
                if prefault(s, libc::MADV_POPULATE_READ) == Some(libc::EFAULT) {
                    faulted.store(true, Ordering::Relaxed);
                    return R::default();
                }
                prefault(d, libc::MADV_POPULATE_WRITE);
            }
            f(offset, s, d)
        };
        let r = if !self.is_parallel(src.len()) {
            chunk(0, src, dst)
        } else {
            let per = per_thread(src.len() / src_size, self.threads, multiple);
            self.pool.install(|| {
                src.par_chunks(per * src_size)
                    .zip(dst.par_chunks_mut(per * dst_size))
                    .enumerate()
                    .map(|(j, (s, d))| chunk(j * per * src_size, s, d))
                    .reduce(R::default, &merge)
            })
        };
        (r, faulted.into_inner())
    }

    /// `split` over two read-only slices (a comparison), without populating.
    pub fn split_pair<R: Send + Default>(
        &self,
        src: &[u8],
        dst: &[u8],
        (src_size, dst_size, multiple): (usize, usize, usize),
        f: impl Fn(usize, &[u8], &[u8]) -> R + Sync,
        merge: impl Fn(R, R) -> R + Sync + Send,
    ) -> R {
        if !self.is_parallel(src.len()) {
            return f(0, src, dst);
        }
        let per = per_thread(src.len() / src_size, self.threads, multiple);
        self.pool.install(|| {
            src.par_chunks(per * src_size)
                .zip(dst.par_chunks(per * dst_size))
                .enumerate()
                .map(|(j, (s, d))| f(j * per * src_size, s, d))
                .reduce(R::default, &merge)
        })
    }

    /// `split` over one read-only slice.
    pub fn split_one<R: Send + Default>(
        &self,
        src: &[u8],
        (size, multiple): (usize, usize),
        f: impl Fn(&[u8]) -> R + Sync,
        merge: impl Fn(R, R) -> R + Sync + Send,
    ) -> R {
        if !self.is_parallel(src.len()) {
            return f(src);
        }
        let per = per_thread(src.len() / size, self.threads, multiple);
        self.pool.install(|| {
            src.par_chunks(per * size)
                .map(&f)
                .reduce(R::default, &merge)
        })
    }

    /// Copy or convert one window; true if the input shrank under it (see `split`).
    pub fn run(&self, action: Action, src: &[u8], dst: &mut [u8]) -> bool {
        let (s, d) = action.sizes();
        let isa = self.isa;
        self.split(
            src,
            dst,
            (s as usize, d as usize, 1024),
            |_, s, d| action.apply(isa, s, d),
            |(), ()| (),
        )
        .1
    }

    /// Fault `src` and `dst` in (when populating), each with one call; true if the input
    /// shrank under it (see `split`).
    pub fn fault_in(&self, src: &[u8], dst: &mut [u8]) -> bool {
        if !self.populate {
            return false;
        }
        if prefault(src, libc::MADV_POPULATE_READ) == Some(libc::EFAULT) {
            return true;
        }
        prefault(dst, libc::MADV_POPULATE_WRITE);
        false
    }

    /// Convert (and measure, when `numerics`) a batch of small whole tensors: `pieces` are
    /// (action, source bytes, output bytes) of consecutive tensors, already faulted in. The
    /// tensors are spread over the threads (each one whole on one thread). Returns one
    /// report per piece (default for copies and unmeasured conversions).
    pub fn run_batch(
        &self,
        pieces: &mut [(Action, &[u8], &mut [u8])],
        numerics: bool,
    ) -> Vec<Numerics> {
        let isa = self.isa;
        let one = |(action, s, d): &mut (Action, &[u8], &mut [u8])| match *action {
            Action::Convert(c) if numerics => fused::convert_and_measure(isa, c, s, d),
            a => {
                a.apply(isa, s, d);
                Numerics::default()
            }
        };
        let bytes: usize = pieces.iter().map(|p| p.1.len()).sum();
        if !self.is_parallel(bytes) {
            return pieces.iter_mut().map(one).collect();
        }
        self.pool
            .install(|| pieces.par_iter_mut().with_min_len(16).map(one).collect())
    }

    /// `run` for a conversion, measuring what it does as it goes (see `numerics`).
    pub fn convert_and_measure(
        &self,
        conv: Conversion,
        src: &[u8],
        dst: &mut [u8],
    ) -> (Numerics, bool) {
        let src_size = conv.src_size() as usize;
        let isa = self.isa;
        // One fused pass per thread's share: each call starts its relative-error maximum
        // afresh, so fewer, larger calls are cheaper (see `fused`).
        let run = |_, src: &[u8], dst: &mut [u8]| fused::convert_and_measure(isa, conv, src, dst);
        let merge = |mut a: Numerics, b: Numerics| {
            a.merge(&b);
            a
        };
        self.split(src, dst, (src_size, 2, 1024), run, merge)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_walks_windows_and_skips_empty_items() {
        let lens = [0u64, 150_000, 0, 70_000];
        let mut c = Cursor::new(65_536, lens.iter().sum());
        let mut seen = Vec::new();
        while let Some(w) = c.peek(lens.len(), |i| lens[i]) {
            seen.push((w.item, w.pos, w.len));
            c.advance(w);
        }
        assert_eq!(
            seen,
            [
                (1, 0, 65_536),
                (1, 65_536, 65_536),
                (1, 131_072, 18_928),
                (3, 0, 65_536),
                (3, 65_536, 4_464)
            ]
        );
        assert_eq!(c.progress(), (220_000, 220_000));
    }

    #[test]
    fn window_rounding() {
        assert_eq!(window_size(0), 64 << 10);
        assert_eq!(window_size((8 << 20) + 63), 8 << 20);
        assert_eq!(per_thread(10_000, 3, 1024), 4096);
    }
}
