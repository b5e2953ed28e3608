//! Read the tensors a plan converts, writing nothing: their largest finite magnitude (to keep
//! those that would overflow, `OnOverflow::Keep`) or their full numerics (`inspect --scan`);
//! and, for an FP8 target whose NaN/inf weights are not known yet, whether each weight it
//! would quantize holds NaN or inf (what the weight becomes, so the plan, depends on it).
//!
//! A dequantized weight's values exist only once dequantized: every scan that measures
//! overflow dequantizes it into a scratch window (`convert::dequantize_step`, as the
//! conversion does), so that a run that would refuse its overflow refuses before writing.
//!
//! A scan is one extra read of the input, window by window with the pages released behind
//! it, so its memory is bounded like a conversion's. It is stepped like a `Job`.

use std::collections::HashSet;

use memmap2::Advice;

use crate::convert::{self, Options};
use crate::dtype::{Action, Conversion};
use crate::error::{Error, Result};
use crate::kernels::Isa;
use crate::numerics::Numerics;
use crate::plan::{self, Plan};
use crate::quant::Packing;
use crate::source::Source;
use crate::vocab::{OnOverflow, Target};
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
    /// What the conversion does to it: a cast, a quantization (read for NaN or inf), or a
    /// dequantization (dequantized into scratch and measured).
    pub action: Action,
    /// What is read of it: a weight to quantize, `NonFinite`; a weight to dequantize,
    /// `Numerics`; another tensor, the scan's kind.
    pub kind: ScanKind,
    /// The largest finite |x| (`MaxAbs` scans of a cast; 0 otherwise).
    pub max_abs: f64,
    /// `Numerics` scans only.
    pub numerics: Option<Numerics>,
    /// `NonFinite` scans: it holds NaN or inf.
    pub nonfinite: bool,
}

impl Scanned {
    /// Would converting this tensor turn a finite value into an infinity?
    pub fn overflows(&self) -> bool {
        match (&self.numerics, self.action) {
            (Some(n), _) => n.overflow > 0,
            (None, Action::Convert(c)) => c.overflows(self.max_abs),
            _ => false,
        }
    }

    /// Is it a weight the conversion dequantizes?
    pub fn dequantized(&self) -> bool {
        matches!(self.action, Action::Dequantize(_))
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
                let kind = match (t.action, kind) {
                    (Action::Quantize(q), _) if weights => {
                        Conversion::from_src(q.d)?;
                        ScanKind::NonFinite
                    }
                    (Action::Convert(_), ScanKind::Numerics) => kind,
                    (Action::Convert(c), ScanKind::MaxAbs) if c.overflows(f64::MAX) => kind,
                    (Action::Dequantize(_), ScanKind::MaxAbs | ScanKind::Numerics) => {
                        ScanKind::Numerics
                    }
                    _ => return None,
                };
                Some(Scanned {
                    source: t.source,
                    name: src.header.tensors[t.source].name.clone(),
                    action: t.action,
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
        // Every conversion at least halves the size: half a window holds its output (a
        // dequantized one's windows are cut so: `convert::dequant_window`).
        let scratch = match tensors.iter().any(|t| t.kind == ScanKind::Numerics) {
            true => vec![0u8; crate::window::window_size(opts.tuning.window)],
            false => Vec::new(),
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

    fn next_window(&mut self) -> Option<Window> {
        let (tensors, src) = (&self.tensors, &self.src);
        let len = |i: usize| src.header.tensors[tensors[i].source].len();
        let mut w = self.cursor.peek(tensors.len(), len)?;
        if let Action::Dequantize(d) = tensors[w.item].action {
            let left = len(w.item) - w.pos;
            w.len = convert::dequant_window(d, self.cursor.window(), w.len, left);
        }
        Some(w)
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
            let action = item.action;
            let (file, at) = self.src.locate(s);
            let at = at + w.pos;
            let (input, item_source) = (s.input, item.source);
            // gpt-oss windows run over the blocks in the output's order, read in place
            // (`convert::dequant_input`), their pages dropped expert by expert.
            let gptoss = matches!(action, Action::Dequantize(d) if matches!(d.packing, Packing::GptOss { .. }));
            file.check_unchanged()?;
            if s.gather.is_none() && !gptoss {
                let _ = file
                    .map
                    .advise_range(Advice::PopulateRead, at as usize, w.len as usize);
            }
            let gathered = s.gather.is_some();
            let done = w.pos + w.len == s.len();
            let bytes = match action {
                Action::Dequantize(d) => {
                    convert::dequant_input(&self.src, s, d, w, &mut self.gathered)?
                }
                _ => self.src.read(s, w.pos, w.len, &mut self.gathered)?,
            };
            let work = Work {
                pool: &self.pool,
                threads: self.threads,
                isa: self.isa,
                // Populated just above, on this thread.
                populate: false,
            };
            let measured = match action {
                Action::Dequantize(d) => {
                    let n = action.out_len(w.len) as usize;
                    if self.scratch.len() < n {
                        self.scratch.resize(n, 0); // one granule longer than half a window
                    }
                    let out = &mut self.scratch[..n];
                    let range = convert::dequantize_step(
                        &self.pool,
                        self.threads,
                        d,
                        &self.src,
                        s,
                        w,
                        bytes,
                        out,
                    );
                    Some(range.numerics())
                }
                Action::Convert(c) if self.tensors[w.item].kind == ScanKind::Numerics => {
                    let out = &mut self.scratch[..action.out_len(w.len) as usize];
                    Some(work.convert_and_measure(c, bytes, out).0)
                }
                _ => None,
            };
            let item = &mut self.tensors[w.item];
            match (item.kind, action, measured) {
                (_, _, Some(measured)) => {
                    item.numerics
                        .get_or_insert_with(Numerics::default)
                        .merge(&measured);
                }
                (ScanKind::MaxAbs, Action::Convert(c), None) => {
                    let size = c.src_size() as usize;
                    let m = work.split_one(bytes, (size, 1024), |s| max_finite_abs(c, s), f64::max);
                    item.max_abs = item.max_abs.max(m);
                }
                (ScanKind::NonFinite, Action::Quantize(q), None) => {
                    let c = Conversion::from_src(q.d).expect("`Scan::new` reads float weights");
                    let (d, size) = (c.src(), c.src_size() as usize);
                    let found = work.split_one(
                        bytes,
                        (size, 1024),
                        |s| crate::fp8::has_nonfinite(d, s),
                        |a, b| a || b,
                    );
                    item.nonfinite |= found;
                }
                _ => unreachable!("`Scan::new` reads each tensor as its kind says"),
            }
            if gptoss {
                // Released expert by expert (`convert::dequantize_step`).
            } else if !gathered {
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

/// The names of the scanned tensors that would overflow and can keep their dtype (not a
/// dequantized weight: see `refusal`).
pub fn overflowing(scanned: &[Scanned]) -> HashSet<String> {
    scanned
        .iter()
        .filter(|t| t.overflows() && !t.dequantized())
        .map(|t| t.name.clone())
        .collect()
}

/// What a conversion of `path` to `target` under `on_overflow` refuses of what the scan
/// found, the error it would fail with once converted: under `Error` any overflow (of the
/// tensors measured: a `Numerics` scan's), under `Keep` a dequantized weight's, which has
/// no dtype of its own to keep. Checked before the first byte is written.
pub fn refusal(
    path: &std::path::Path,
    target: Target,
    on_overflow: OnOverflow,
    scanned: &[Scanned],
) -> Option<Error> {
    let measured = scanned
        .iter()
        .filter_map(|t| Some((t.name.as_str(), t.numerics.as_ref()?)));
    match on_overflow {
        OnOverflow::Warn => None,
        OnOverflow::Error => {
            let measured: Vec<(&str, &Numerics)> = measured.collect();
            let dequantized =
                |name: &str| scanned.iter().any(|t| t.dequantized() && t.name == name);
            plan::overflow_outcome(path, target, &measured, dequantized).map(|(error, _)| error)
        }
        OnOverflow::Keep => {
            let mut dequantized = scanned.iter().filter(|t| t.dequantized());
            let (name, n) = dequantized.find_map(|t| {
                let n = t.numerics.as_ref().filter(|n| n.overflow > 0)?;
                Some((t.name.as_str(), n))
            })?;
            Some(convert::unkeepable_overflow(path, name, n.overflow, target))
        }
    }
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
