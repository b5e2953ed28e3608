//! Read the tensors a plan converts, writing nothing: their largest finite magnitude (to keep
//! those that would overflow, `OnOverflow::Keep`) or their full numerics (`inspect --scan`).
//!
//! A scan is one extra read of the input, window by window with the pages released behind
//! it, so its memory is bounded like a conversion's. It is stepped like a `Job`.

use std::collections::HashSet;
use std::path::Path;

use memmap2::Advice;
use rayon::prelude::*;

use crate::convert::{self, Job, Options, Source};
use crate::error::{Error, Result};
use crate::header::Target;
use crate::header::{self, Action, Conversion, Plan};
use crate::kernels::Isa;
use crate::numerics::Numerics;

/// What to do when finite values would become infinite.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnOverflow {
    /// Convert, count, and say which tensors overflowed.
    #[default]
    Warn,
    /// Fail before publishing: nothing is left behind.
    Error,
    /// Scan first and keep the tensors that would overflow in their source dtype.
    Keep,
}

impl OnOverflow {
    pub fn parse(s: &str) -> Option<OnOverflow> {
        match s {
            "warn" => Some(OnOverflow::Warn),
            "error" => Some(OnOverflow::Error),
            "keep" => Some(OnOverflow::Keep),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OnOverflow::Warn => "warn",
            OnOverflow::Error => "error",
            OnOverflow::Keep => "keep",
        }
    }
}

/// What a scan reads of each tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanKind {
    /// The largest finite magnitude: enough to tell whether a tensor overflows. Tensors whose
    /// conversion cannot overflow (F16 -> BF16) are not read.
    MaxAbs,
    /// Convert into a scratch window and measure it (overflow, underflow, errors).
    Numerics,
}

/// One tensor of a finished scan.
#[derive(Clone, Debug)]
pub struct Scanned {
    /// Index into `SourceHeader::tensors`.
    pub source: usize,
    pub name: String,
    pub conversion: Conversion,
    /// The largest finite |x| (`MaxAbs` scans; 0 otherwise).
    pub max_abs: f64,
    /// `Numerics` scans only.
    pub numerics: Option<Numerics>,
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
    kind: ScanKind,
    tensors: Vec<Scanned>,
    pool: rayon::ThreadPool,
    threads: usize,
    isa: Isa,
    window: usize,
    scratch: Vec<u8>,
    next: usize,
    pos: u64,
    done: u64,
    total: u64,
}

impl Scan {
    /// Plan to read every tensor that `plan` converts (of `src`'s header).
    pub fn new(src: Source, plan: &Plan, kind: ScanKind, opts: &Options) -> Result<Scan> {
        let mut tensors: Vec<Scanned> = plan
            .tensors
            .iter()
            .filter_map(|t| match t.action {
                Action::Convert(c) if kind == ScanKind::Numerics || c.overflows(f64::MAX) => {
                    Some(Scanned {
                        source: t.source,
                        name: src.header.tensors[t.source].name.clone(),
                        conversion: c,
                        max_abs: 0.0,
                        numerics: None,
                    })
                }
                _ => None,
            })
            .collect();
        // File order: the read goes front to back.
        tensors.sort_by_key(|t| t.source);
        let total = tensors
            .iter()
            .map(|t| src.header.tensors[t.source].len())
            .sum();
        let (pool, threads) = convert::worker_pool(opts.threads, "stcast-scan", &src.path)?;
        let window = (opts.window.max(64 << 10)) & !63;
        let scratch = match kind {
            // Every conversion at least halves the size: half a window holds its output.
            ScanKind::Numerics => vec![0u8; window],
            ScanKind::MaxAbs => Vec::new(),
        };
        let _ = src.map.advise(Advice::Sequential);
        Ok(Scan {
            src,
            kind,
            tensors,
            pool,
            threads,
            isa: opts.isa.unwrap_or_else(Isa::detect),
            window,
            scratch,
            next: 0,
            pos: 0,
            done: 0,
            total,
        })
    }

    /// Source data bytes read and to read.
    pub fn progress(&self) -> (u64, u64) {
        (self.done, self.total)
    }

    /// The header of the input being scanned.
    pub fn source(&self) -> &crate::header::SourceHeader {
        &self.src.header
    }

    /// The tensors this scan reads (and, once finished, what it found).
    pub fn tensors(&self) -> &[Scanned] {
        &self.tensors
    }

    /// Read about `budget` source bytes (whole windows). Returns true when all is read.
    pub fn step(&mut self, budget: u64) -> Result<bool> {
        let mut spent = 0u64;
        while spent < budget && self.next < self.tensors.len() {
            let item = &self.tensors[self.next];
            let s = &self.src.header.tensors[item.source];
            let len = s.len();
            if self.pos >= len {
                self.next += 1;
                self.pos = 0;
                continue;
            }
            let c = item.conversion;
            let n = (self.window as u64).min(len - self.pos);
            let at = self.src.header.data_start() + s.start + self.pos;
            let (a, b) = (at as usize, (at + n) as usize);
            self.src.check_unchanged()?;
            let _ = self.src.map.advise_range(Advice::PopulateRead, a, b - a);
            let bytes = &self.src.map[a..b];
            match self.kind {
                ScanKind::MaxAbs => {
                    let m = max_finite_abs(&self.pool, self.threads, c, bytes);
                    let item = &mut self.tensors[self.next];
                    item.max_abs = item.max_abs.max(m);
                }
                ScanKind::Numerics => {
                    let out = &mut self.scratch[..(n / c.src_size() * 2) as usize];
                    let work = convert::Work {
                        pool: &self.pool,
                        threads: self.threads,
                        isa: self.isa,
                        // Populated just above, on this thread.
                        populate: false,
                    };
                    let (measured, _) = work.convert_and_measure(c, bytes, out);
                    let item = &mut self.tensors[self.next];
                    match &mut item.numerics {
                        Some(total) => total.merge(&measured),
                        None => item.numerics = Some(measured),
                    }
                }
            }
            self.src.release((at, at + n));
            self.pos += n;
            self.done += n;
            spent += n;
        }
        Ok(self.next >= self.tensors.len())
    }

    /// The source (for the conversion that follows) and what was found, in file order.
    pub fn finish(self) -> (Source, Vec<Scanned>) {
        (self.src, self.tensors)
    }
}

/// Finite values that became (or would become) infinite: what the overflow guard reports.
#[derive(Clone, Debug, PartialEq)]
pub struct Overflow {
    pub target: Target,
    /// Values in all.
    pub values: u64,
    /// (tensor, values), most first (ties in the order given).
    pub tensors: Vec<(String, u64)>,
}

impl Overflow {
    /// The tensors of `numerics` that overflowed, if any did.
    pub fn find(numerics: &[(String, Numerics)], target: Target) -> Option<Overflow> {
        let mut tensors: Vec<(String, u64)> = numerics
            .iter()
            .filter(|(_, n)| n.overflow > 0)
            .map(|(name, n)| (name.clone(), n.overflow))
            .collect();
        if tensors.is_empty() {
            return None;
        }
        tensors.sort_by_key(|t| std::cmp::Reverse(t.1));
        Some(Overflow {
            target,
            values: tensors.iter().map(|t| t.1).sum(),
            tensors,
        })
    }

    /// "`a` (10), `b` (1) and 3 more": the worst few tensors.
    fn worst(&self) -> String {
        const SHOWN: usize = 5;
        let mut list = self
            .tensors
            .iter()
            .take(SHOWN)
            .map(|(name, n)| format!("`{name}` ({n})"))
            .collect::<Vec<_>>()
            .join(", ");
        if self.tensors.len() > SHOWN {
            list.push_str(&format!(" and {} more", self.tensors.len() - SHOWN));
        }
        list
    }

    fn counted(&self) -> String {
        let values = plural(self.values, "finite value");
        let tensors = plural(self.tensors.len() as u64, "tensor");
        format!("{values} in {tensors}")
    }

    /// The `OnOverflow::Warn` message.
    pub fn warning(&self) -> String {
        format!(
            "{} became ±inf in {}: {}; keep them in their dtype with --on-overflow keep \
             (or --keep)",
            self.counted(),
            self.target.dtype(),
            self.worst()
        )
    }

    /// The `OnOverflow::Error` refusal, about the input `path`.
    pub fn error(&self, path: &Path) -> Error {
        let (name, n) = &self.tensors[0];
        Error::refused(
            path,
            format!(
                "{} would become ±inf in {}, most in tensor `{name}` ({n}); nothing was \
                 written (--on-overflow error); keep them in their dtype with --on-overflow \
                 keep (or --keep)",
                self.counted(),
                self.target.dtype()
            ),
        )
    }
}

fn plural(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// The names of the scanned tensors that would overflow.
pub fn overflowing(scanned: &[Scanned]) -> HashSet<String> {
    scanned
        .iter()
        .filter(|t| t.overflows())
        .map(|t| t.name.clone())
        .collect()
}

/// The first half of `OnOverflow::Keep`: open `src_path`, refuse a bad destination before the
/// long read, plan without the overflow rule and set up the scan of the float tensors.
pub fn overflow_scan(src_path: &Path, dst: &Path, opts: &Options) -> Result<Scan> {
    let src = Source::open(src_path)?;
    convert::check_destination(&src, dst, opts.force)?;
    let plan = header::plan(src_path, &src.header, &opts.plan_options())?;
    Scan::new(src, &plan, ScanKind::MaxAbs, opts)
}

/// The second half: the job that converts, keeping the tensors the scan found would overflow.
pub fn keep_job(scan: Scan, dst: &Path, opts: &Options) -> Result<Job> {
    let (src, scanned) = scan.finish();
    let mut opts = opts.clone();
    opts.keep_names.extend(overflowing(&scanned));
    Job::with_source(src, dst, &opts)
}

/// The largest finite |x| of a window of `c`'s source elements, as f64 (exact).
fn max_finite_abs(pool: &rayon::ThreadPool, threads: usize, c: Conversion, src: &[u8]) -> f64 {
    let one = |s: &[u8]| -> f64 {
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
    };
    if threads <= 1 || src.len() < (512 << 10) {
        return one(src);
    }
    let size = c.src_size() as usize;
    let per = (src.len() / size).div_ceil(threads).next_multiple_of(1024) * size;
    pool.install(|| src.par_chunks(per).map(one).reduce(|| 0.0, f64::max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_abs_ignores_nan_and_inf() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let f32s: Vec<u8> = [1.0f32, -70000.0, f32::NAN, f32::NEG_INFINITY, 3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(
            max_finite_abs(&pool, 1, Conversion::F32ToF16, &f32s),
            70000.0
        );
        let f64s: Vec<u8> = [f64::INFINITY, -1e300, 2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(
            max_finite_abs(&pool, 1, Conversion::F64ToBf16, &f64s),
            1e300
        );
        let bf16s: Vec<u8> = [0x7F80u16, 0xC780, 0x7FC1, 0x3F80]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(
            max_finite_abs(&pool, 1, Conversion::Bf16ToF16, &bf16s),
            65536.0
        );
    }

    /// A file with tensors `ok` (small F32), `hot` (one F32 value overflows in f16) and
    /// `ids` (I64), in a fresh folder.
    fn overflow_file(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("stcast-scan-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let h = r#"{"ok":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"hot":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"ids":{"dtype":"I64","shape":[1],"data_offsets":[16,24]}}"#;
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(h.as_bytes());
        for x in [1.0f32, 2.0, 65520.0, 3.0] {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        bytes.extend_from_slice(&7i64.to_le_bytes());
        let src = dir.join("in.safetensors");
        std::fs::write(&src, bytes).unwrap();
        (dir, src)
    }

    #[test]
    fn convert_keeps_or_refuses_what_would_overflow() {
        let (dir, src) = overflow_file("modes");
        let opts = |on_overflow| Options {
            target: Target::F16,
            on_overflow,
            threads: 1,
            ..Options::default()
        };
        // Keep: the scan finds `hot`, which keeps its F32 bytes.
        let dst = dir.join("keep.safetensors");
        let r = convert::convert(&src, &dst, &opts(OnOverflow::Keep)).unwrap();
        assert_eq!(r.kept.len(), 1);
        assert_eq!(r.kept[0].name, "hot");
        assert_eq!(r.kept[0].reason, header::Reason::KeptToAvoidOverflow);
        assert_eq!(r.tensors_converted, 1);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        // Error: nothing is published.
        let dst = dir.join("error.safetensors");
        let e = convert::convert(&src, &dst, &opts(OnOverflow::Error)).unwrap_err();
        assert_eq!(e.kind(), "refused");
        assert!(e.to_string().contains("most in tensor `hot` (1)"), "{e}");
        assert!(!dst.exists());
        // Warn: published, with the warning.
        let dst = dir.join("warn.safetensors");
        let r = convert::convert(&src, &dst, &opts(OnOverflow::Warn)).unwrap();
        assert!(r.warnings[0].starts_with("1 finite value in 1 tensor became ±inf in F16"));
        assert_eq!(
            r.numerics.iter().find(|n| n.0 == "hot").unwrap().1.overflow,
            1
        );
        // The max-abs scan and the numerics scan agree on what overflows.
        for kind in [ScanKind::MaxAbs, ScanKind::Numerics] {
            let source = Source::open(&src).unwrap();
            let plan = header::plan(&src, &source.header, &opts(OnOverflow::Keep).plan_options());
            let mut scan =
                Scan::new(source, &plan.unwrap(), kind, &opts(OnOverflow::Keep)).unwrap();
            while !scan.step(1).unwrap() {}
            let (_, found) = scan.finish();
            let names: Vec<_> = overflowing(&found).into_iter().collect();
            assert_eq!(names, ["hot"], "{kind:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn overflow_messages_name_the_worst_tensors() {
        let n = |overflow| Numerics {
            overflow,
            ..Numerics::default()
        };
        let all: Vec<(String, Numerics)> = (0..8)
            .map(|i| (format!("t{i}"), n(if i == 0 { 0 } else { i })))
            .collect();
        assert_eq!(Overflow::find(&all[..1], Target::F16), None);
        let o = Overflow::find(&all, Target::F16).unwrap();
        assert_eq!(o.values, 28);
        assert_eq!(o.tensors[0], ("t7".to_string(), 7));
        let w = o.warning();
        assert!(
            w.starts_with("28 finite values in 7 tensors became ±inf in F16: `t7` (7), `t6` (6)"),
            "{w}"
        );
        assert!(w.contains("`t3` (3) and 2 more;"), "{w}");
        let e = o.error(Path::new("m.safetensors")).to_string();
        assert!(e.starts_with("m.safetensors: 28 finite values in 7 tensors would become ±inf in F16, most in tensor `t7` (7); nothing was written"), "{e}");
        let one = Overflow::find(&all[..2], Target::Bf16).unwrap();
        assert!(one
            .warning()
            .starts_with("1 finite value in 1 tensor became ±inf in BF16: `t1` (1);"));
    }

    #[test]
    fn thresholds_are_the_kernels_overflow_points() {
        use crate::kernels::{bf16_from_f32, f16_from_f32};
        assert_eq!(f32::from_bits(0x7F7F_8000) as f64, header::BF16_OVERFLOW);
        for (u, c) in [
            (0x7F7F_8000u32, Conversion::F32ToBf16),
            (0x477F_F000, Conversion::F32ToF16),
        ] {
            let x = f64::from(f32::from_bits(u));
            let below = f64::from(f32::from_bits(u - 1));
            assert!(c.overflows(x) && !c.overflows(below));
            let out = match c {
                Conversion::F32ToBf16 => (bf16_from_f32(u), bf16_from_f32(u - 1)),
                _ => (f16_from_f32(u), f16_from_f32(u - 1)),
            };
            let inf = if c == Conversion::F32ToBf16 {
                0x7F80
            } else {
                0x7C00
            };
            assert_eq!(out.0, inf);
            assert_ne!(out.1, inf);
        }
    }
}
