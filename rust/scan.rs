//! Read the tensors a plan converts, writing nothing: their largest finite magnitude (to keep
//! those that would overflow, `OnOverflow::Keep`) or their full numerics (`inspect --scan`);
//! and, for an FP8 target whose NaN/inf weights are not known yet, whether each weight it
//! would quantize holds NaN or inf (what the weight becomes, so the plan, depends on it).
//!
//! A scan is one extra read of the input, window by window with the pages released behind
//! it, so its memory is bounded like a conversion's. It is stepped like a `Job`.

use std::collections::HashSet;

use memmap2::Advice;

use crate::convert::Options;
use crate::dtype::{Action, Conversion};
use crate::error::Result;
use crate::kernels::Isa;
use crate::numerics::Numerics;
use crate::plan::Plan;
use crate::source::Source;
use crate::window::{worker_pool, Cursor, Window, Work};

/// What a scan reads of each tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanKind {
    /// The largest finite magnitude: enough to tell whether a tensor overflows. Tensors whose
    /// conversion cannot overflow (F16 -> BF16) are not read.
    MaxAbs,
    /// Convert into a scratch window and measure it (overflow, underflow, errors).
    Numerics,
    /// An FP8 target's weights: does any hold NaN or inf? (Every scan of a plan whose
    /// `unquantized` is not known reads its weights so; this kind reads nothing else.)
    NonFinite,
}

/// One tensor of a finished scan.
#[derive(Clone, Debug)]
pub struct Scanned {
    /// Index into `SourceHeader::tensors`.
    pub source: usize,
    pub name: String,
    pub conversion: Conversion,
    /// What is read of it: a weight to quantize, `NonFinite`; another tensor, the scan's kind.
    pub kind: ScanKind,
    /// The largest finite |x| (`MaxAbs` scans; 0 otherwise).
    pub max_abs: f64,
    /// `Numerics` scans only.
    pub numerics: Option<Numerics>,
    /// `NonFinite` scans: it holds NaN or inf.
    pub nonfinite: bool,
}

impl Scanned {
    /// Would converting this tensor turn a finite value into an infinity?
    pub fn overflows(&self) -> bool {
        match &self.numerics {
            Some(n) => n.overflow > 0,
            None => self.conversion.overflows(self.max_abs),
        }
    }
}

/// A scan in progress over the tensors a plan converts, in file order.
pub struct Scan {
    src: Source,
    tensors: Vec<Scanned>,
    pool: rayon::ThreadPool,
    threads: usize,
    isa: Isa,
    scratch: Vec<u8>,
    /// Where views that are not one run (strided, big-endian) are gathered.
    gathered: Vec<u8>,
    cursor: Cursor,
}

impl Scan {
    /// Plan to read every tensor that `plan` converts (of `src`'s header) as `kind` says,
    /// and every weight it quantizes when `opts` does not know yet which hold NaN or inf.
    pub fn new(src: Source, plan: &Plan, kind: ScanKind, opts: &Options) -> Result<Scan> {
        let weights = opts.plan.unquantized.is_none();
        let mut tensors: Vec<Scanned> = plan
            .tensors
            .iter()
            .filter_map(|t| {
                let (c, kind) = match (t.action, kind) {
                    (Action::Quantize(q), _) if weights => {
                        (Conversion::from_src(q.d)?, ScanKind::NonFinite)
                    }
                    (Action::Convert(c), ScanKind::Numerics) => (c, kind),
                    (Action::Convert(c), ScanKind::MaxAbs) if c.overflows(f64::MAX) => (c, kind),
                    _ => return None,
                };
                Some(Scanned {
                    source: t.source,
                    name: src.header.tensors[t.source].name.clone(),
                    conversion: c,
                    kind,
                    max_abs: 0.0,
                    numerics: None,
                    nonfinite: false,
                })
            })
            .collect();
        // File order: the read goes front to back.
        tensors.sort_by_key(|t| t.source);
        let total = tensors
            .iter()
            .map(|t| src.header.tensors[t.source].len())
            .sum();
        let (pool, threads) = worker_pool(opts.threads, "stcast-scan", &src.path)?;
        let cursor = Cursor::new(opts.tuning.window, total);
        let scratch = match kind {
            // Every conversion at least halves the size: half a window holds its output.
            ScanKind::Numerics => vec![0u8; crate::window::window_size(opts.tuning.window)],
            ScanKind::MaxAbs | ScanKind::NonFinite => Vec::new(),
        };
        src.advise(Advice::Sequential);
        Ok(Scan {
            src,
            tensors,
            pool,
            threads,
            isa: opts.tuning.isa.unwrap_or_else(Isa::detect),
            scratch,
            gathered: Vec::new(),
            cursor,
        })
    }

    /// Source data bytes read and to read.
    pub fn progress(&self) -> (u64, u64) {
        self.cursor.progress()
    }

    /// The input being scanned.
    pub fn source(&self) -> &Source {
        &self.src
    }

    /// The tensors this scan reads (and, once finished, what it found).
    pub fn tensors(&self) -> &[Scanned] {
        &self.tensors
    }

    fn next_window(&mut self) -> Option<Window> {
        let (tensors, src) = (&self.tensors, &self.src);
        self.cursor.peek(tensors.len(), |i| {
            src.header.tensors[tensors[i].source].len()
        })
    }

    /// Read about `budget` source bytes (whole windows). Returns true when all is read.
    pub fn step(&mut self, budget: u64) -> Result<bool> {
        let mut spent = 0u64;
        while spent < budget {
            let Some(w) = self.next_window() else {
                break;
            };
            let item = &self.tensors[w.item];
            let s = &self.src.header.tensors[item.source];
            let c = item.conversion;
            let (file, at) = self.src.locate(s);
            let at = at + w.pos;
            let (input, item_source) = (s.input, item.source);
            file.check_unchanged()?;
            if s.gather.is_none() {
                let _ = file
                    .map
                    .advise_range(Advice::PopulateRead, at as usize, w.len as usize);
            }
            let gathered = s.gather.is_some();
            let done = w.pos + w.len == s.len();
            let bytes = self.src.read(s, w.pos, w.len, &mut self.gathered)?;
            let work = Work {
                pool: &self.pool,
                threads: self.threads,
                isa: self.isa,
                // Populated just above, on this thread.
                populate: false,
            };
            let item = &mut self.tensors[w.item];
            match item.kind {
                ScanKind::MaxAbs => {
                    let size = c.src_size() as usize;
                    let m = work.split_one(bytes, (size, 1024), |s| max_finite_abs(c, s), f64::max);
                    item.max_abs = item.max_abs.max(m);
                }
                ScanKind::NonFinite => {
                    let d = c.src();
                    let size = c.src_size() as usize;
                    let found = work.split_one(
                        bytes,
                        (size, 1024),
                        |s| crate::fp8::has_nonfinite(d, s),
                        |a, b| a || b,
                    );
                    item.nonfinite |= found;
                }
                ScanKind::Numerics => {
                    let out = &mut self.scratch[..Action::Convert(c).out_len(w.len) as usize];
                    let (measured, _) = work.convert_and_measure(c, bytes, out);
                    item.numerics
                        .get_or_insert_with(Numerics::default)
                        .merge(&measured);
                }
            }
            if !gathered {
                self.src.files[input].release((at, at + w.len));
            } else if done {
                // A view's elements lie anywhere in its storage: drop its pages once done.
                self.src
                    .release_gathered(&self.src.header.tensors[item_source]);
            }
            self.cursor.advance(w);
            spent += w.len;
        }
        Ok(self.next_window().is_none())
    }

    /// The source (for the conversion that follows) and what was found, in file order.
    pub fn finish(self) -> (Source, Vec<Scanned>) {
        (self.src, self.tensors)
    }
}

/// The names of the scanned tensors that hold NaN or inf (`ScanKind::NonFinite`).
pub fn nonfinite(scanned: &[Scanned]) -> HashSet<String> {
    scanned
        .iter()
        .filter(|t| t.nonfinite)
        .map(|t| t.name.clone())
        .collect()
}

/// The names of the scanned tensors that would overflow.
pub fn overflowing(scanned: &[Scanned]) -> HashSet<String> {
    scanned
        .iter()
        .filter(|t| t.overflows())
        .map(|t| t.name.clone())
        .collect()
}

/// The largest finite |x| of `src`, elements of `c`'s source dtype, as f64 (exact).
pub(crate) fn max_finite_abs(c: Conversion, s: &[u8]) -> f64 {
    match c.src_size() {
        2 => {
            // BF16 (the only 2-byte source that can overflow).
            let m = s.as_chunks::<2>().0.iter().fold(0u16, |m, b| {
                let a = u16::from_le_bytes(*b) & 0x7FFF;
                if a < 0x7F80 {
                    m.max(a)
                } else {
                    m
                }
            });
            f64::from(f32::from_bits(u32::from(m) << 16))
        }
        4 => {
            let m = s.as_chunks::<4>().0.iter().fold(0u32, |m, b| {
                let a = u32::from_le_bytes(*b) & 0x7FFF_FFFF;
                if a < 0x7F80_0000 {
                    m.max(a)
                } else {
                    m
                }
            });
            f64::from(f32::from_bits(m))
        }
        _ => {
            let m = s.as_chunks::<8>().0.iter().fold(0u64, |m, b| {
                let a = u64::from_le_bytes(*b) & 0x7FFF_FFFF_FFFF_FFFF;
                if a < 0x7FF0_0000_0000_0000 {
                    m.max(a)
                } else {
                    m
                }
            });
            f64::from_bits(m)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_abs_ignores_nan_and_inf() {
        let f32s: Vec<u8> = [1.0f32, -70000.0, f32::NAN, f32::NEG_INFINITY, 3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(max_finite_abs(Conversion::F32ToF16, &f32s), 70000.0);
        let f64s: Vec<u8> = [f64::INFINITY, -1e300, 2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(max_finite_abs(Conversion::F64ToBf16, &f64s), 1e300);
        let bf16s: Vec<u8> = [0x7F80u16, 0xC780, 0x7FC1, 0x3F80]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(max_finite_abs(Conversion::Bf16ToF16, &bf16s), 65536.0);
    }
}
