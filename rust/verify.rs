//! Prove that one file is exactly the conversion of another, streaming both in bounded memory.
//!
//! The expected action for each tensor is inferred from the destination: same dtype means
//! identical bytes; a BF16 or F16 tensor whose source is a float must equal the conversion
//! recomputed window by window. So files made with any target (or with tensors kept) verify.

use std::path::{Path, PathBuf};
use std::time::Instant;

use safetensors::tensor::Dtype;

use crate::convert::{run_window, Source};
use crate::error::{Error, Result};
use crate::header::{width_rank, Action, Conversion, SourceTensor};
use crate::kernels::Isa;

/// How strictly to compare.
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    /// For files written by other tools: tensor order, metadata order, alignment and NaN
    /// encodings are not compared (a NaN only has to stay a NaN).
    pub loose: bool,
    /// Worker threads; 0 means one per available core.
    pub threads: usize,
    /// Source bytes per window.
    pub window: usize,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            loose: false,
            threads: 0,
            window: crate::convert::DEFAULT_WINDOW,
        }
    }
}

/// The first difference found.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// One line saying what differs.
    pub message: String,
    pub tensor: Option<String>,
    /// Element index within the tensor, for data mismatches.
    pub index: Option<u64>,
    /// Source element bits (hex, source width), expected and found output bits (hex).
    pub source_bits: Option<String>,
    pub source_value: Option<f64>,
    pub expected_bits: Option<String>,
    pub found_bits: Option<String>,
}

impl Mismatch {
    fn header(tensor: Option<&str>, message: String) -> Box<Mismatch> {
        Box::new(Mismatch {
            message,
            tensor: tensor.map(str::to_string),
            index: None,
            source_bits: None,
            source_value: None,
            expected_bits: None,
            found_bits: None,
        })
    }
}

/// The outcome of a verification.
#[derive(Clone, Debug)]
pub struct VerifyReport {
    pub src: PathBuf,
    pub dst: PathBuf,
    pub loose: bool,
    pub tensors_converted: usize,
    pub tensors_identical: usize,
    pub bytes_compared: u64,
    pub seconds: f64,
    pub mismatch: Option<Mismatch>,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.mismatch.is_none()
    }
}

#[derive(Clone, Copy)]
enum Expect {
    Identical,
    Convert(Conversion),
}

fn expectation(src: Dtype, dst: Dtype) -> Option<Expect> {
    use Conversion::*;
    Some(match (src, dst) {
        (a, b) if a == b => Expect::Identical,
        (Dtype::F32, Dtype::BF16) => Expect::Convert(F32ToBf16),
        (Dtype::F16, Dtype::BF16) => Expect::Convert(F16ToBf16),
        (Dtype::F64, Dtype::BF16) => Expect::Convert(F64ToBf16),
        (Dtype::F32, Dtype::F16) => Expect::Convert(F32ToF16),
        (Dtype::F64, Dtype::F16) => Expect::Convert(F64ToF16),
        _ => return None,
    })
}

/// Check that `dst` is exactly what stcast makes of `src`.
pub fn verify(src_path: &Path, dst_path: &Path, opts: &VerifyOptions) -> Result<VerifyReport> {
    let started = Instant::now();
    let src = Source::open(src_path)?;
    let dst = Source::open(dst_path)?;
    let mut report = VerifyReport {
        src: src_path.to_path_buf(),
        dst: dst_path.to_path_buf(),
        loose: opts.loose,
        tensors_converted: 0,
        tensors_identical: 0,
        bytes_compared: 0,
        seconds: 0.0,
        mismatch: None,
    };
    let pairs = match check_headers(&src, &dst, opts.loose) {
        Ok(p) => p,
        Err(m) => {
            report.mismatch = Some(*m);
            report.seconds = started.elapsed().as_secs_f64();
            return Ok(report);
        }
    };
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        opts.threads
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| {
            Error::io(
                dst_path,
                "cannot start worker threads",
                std::io::Error::other(e),
            )
        })?;
    let isa = Isa::detect();
    let window = opts.window.max(64 << 10) & !63;
    let mut scratch = Vec::new();
    // In destination order: the destination is read front to back.
    for (s, d, expect) in pairs {
        let (s, d) = (&src.header.tensors[s], &dst.header.tensors[d]);
        match expect {
            Expect::Identical => report.tensors_identical += 1,
            Expect::Convert(_) => report.tensors_converted += 1,
        }
        let m = compare_tensor(
            &pool,
            isa,
            window,
            &src,
            s,
            &dst,
            d,
            expect,
            opts.loose,
            &mut scratch,
        );
        report.bytes_compared += s.len() + d.len();
        if let Some(m) = m {
            report.mismatch = Some(m);
            break;
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Compare names, shapes, dtypes, metadata and (unless loose) order and alignment.
/// Returns (source index, destination index, expectation) in destination order.
fn check_headers(
    src: &Source,
    dst: &Source,
    loose: bool,
) -> std::result::Result<Vec<(usize, usize, Expect)>, Box<Mismatch>> {
    let (sh, dh) = (&src.header, &dst.header);
    let by_name: std::collections::HashMap<&str, usize> = sh
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut pairs = Vec::with_capacity(dh.tensors.len());
    for (di, d) in dh.tensors.iter().enumerate() {
        let Some(&si) = by_name.get(d.name.as_str()) else {
            return Err(Mismatch::header(
                Some(&d.name),
                format!(
                    "tensor `{}` is in DST but not in SRC: DST is not a conversion of SRC",
                    d.name
                ),
            ));
        };
        let s = &sh.tensors[si];
        if s.shape != d.shape {
            return Err(Mismatch::header(
                Some(&d.name),
                format!(
                    "tensor `{}`: shape {:?} in SRC, {:?} in DST",
                    d.name, s.shape, d.shape
                ),
            ));
        }
        let Some(expect) = expectation(s.dtype, d.dtype) else {
            return Err(Mismatch::header(
                Some(&d.name),
                format!(
                    "tensor `{}`: {} in SRC cannot become {} in DST",
                    d.name, s.dtype, d.dtype
                ),
            ));
        };
        pairs.push((si, di, expect));
    }
    if sh.tensors.len() != dh.tensors.len() {
        let in_dst: std::collections::HashSet<&str> =
            dh.tensors.iter().map(|t| t.name.as_str()).collect();
        let missing = sh
            .tensors
            .iter()
            .find(|t| !in_dst.contains(t.name.as_str()))
            .map_or("?", |t| t.name.as_str());
        return Err(Mismatch::header(
            Some(missing),
            format!("tensor `{missing}` is in SRC but not in DST"),
        ));
    }
    let same_metadata = if loose {
        let sorted = |m: &Option<Vec<(String, String)>>| {
            m.clone().map(|mut v| {
                v.sort();
                v
            })
        };
        sorted(&sh.metadata) == sorted(&dh.metadata)
    } else {
        sh.metadata == dh.metadata
    };
    if !same_metadata {
        return Err(Mismatch::header(None, "__metadata__ differs".into()));
    }
    if !loose {
        // The order stcast plans: source order, stably grouped by output width.
        let mut expected: Vec<usize> = (0..pairs.len()).collect();
        expected.sort_by_key(|&i| {
            let (si, di, _) = pairs[i];
            (std::cmp::Reverse(width_rank(dh.tensors[di].dtype)), si)
        });
        let mut planned: Vec<usize> = expected.iter().map(|&i| pairs[i].0).collect();
        let actual: Vec<usize> = pairs.iter().map(|p| p.0).collect();
        if planned != actual {
            let at = planned
                .iter()
                .zip(&actual)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            let want = &sh.tensors[planned[at]].name;
            let got = &sh.tensors[actual[at]].name;
            planned.clear();
            return Err(Mismatch::header(
                Some(got),
                format!("tensor order differs at position {at}: expected `{want}`, found `{got}`"),
            ));
        }
        if !dst.header.data_start().is_multiple_of(8) {
            return Err(Mismatch::header(
                None,
                "DST header is not padded to 8 bytes".into(),
            ));
        }
        for d in &dh.tensors {
            let size = (d.dtype.bitsize() / 8).max(1) as u64;
            if d.start % size != 0 {
                return Err(Mismatch::header(
                    Some(&d.name),
                    format!("tensor `{}` is not aligned to its element size", d.name),
                ));
            }
        }
    }
    Ok(pairs)
}

#[allow(clippy::too_many_arguments)]
fn compare_tensor(
    pool: &rayon::ThreadPool,
    isa: Isa,
    window: usize,
    src: &Source,
    s: &SourceTensor,
    dst: &Source,
    d: &SourceTensor,
    expect: Expect,
    loose: bool,
    scratch: &mut Vec<u8>,
) -> Option<Mismatch> {
    let (src_size, dst_size) = match expect {
        Expect::Identical => (1u64, 1u64),
        Expect::Convert(c) => (c.src_size(), 2),
    };
    let mut pos = 0u64;
    while pos < s.len() {
        let n = (window as u64).min(s.len() - pos);
        let sa = (src.header.data_start() + s.start + pos) as usize;
        let da = (dst.header.data_start() + d.start + pos / src_size * dst_size) as usize;
        let dn = (n / src_size * dst_size) as usize;
        let src_bytes = &src.map[sa..sa + n as usize];
        let dst_bytes = &dst.map[da..da + dn];
        let differs = match expect {
            Expect::Identical => src_bytes != dst_bytes,
            Expect::Convert(c) => {
                scratch.resize(dn, 0);
                run_window(
                    pool,
                    pool.current_num_threads(),
                    isa,
                    Action::Convert(c),
                    src_bytes,
                    scratch,
                );
                if loose {
                    !same_modulo_nan(c, scratch, dst_bytes)
                } else {
                    scratch.as_slice() != dst_bytes
                }
            }
        };
        if differs {
            return Some(describe(
                s,
                pos / src_size,
                expect,
                src_bytes,
                scratch,
                dst_bytes,
                loose,
            ));
        }
        src.release((sa as u64, sa as u64 + n));
        dst.release((da as u64, (da + dn) as u64));
        pos += n;
    }
    None
}

fn is_nan16(c: Conversion, bits: u16) -> bool {
    match c {
        Conversion::F32ToF16 | Conversion::F64ToF16 => {
            bits & 0x7C00 == 0x7C00 && bits & 0x03FF != 0
        }
        _ => bits & 0x7F80 == 0x7F80 && bits & 0x007F != 0,
    }
}

fn same_modulo_nan(c: Conversion, want: &[u8], got: &[u8]) -> bool {
    want.chunks_exact(2).zip(got.chunks_exact(2)).all(|(w, g)| {
        let (w, g) = (
            u16::from_le_bytes([w[0], w[1]]),
            u16::from_le_bytes([g[0], g[1]]),
        );
        w == g || (is_nan16(c, w) && is_nan16(c, g))
    })
}

fn describe(
    s: &SourceTensor,
    first: u64,
    expect: Expect,
    src: &[u8],
    want: &[u8],
    got: &[u8],
    loose: bool,
) -> Mismatch {
    match expect {
        Expect::Identical => {
            let i = src.iter().zip(got).position(|(a, b)| a != b).unwrap_or(0);
            let es = (s.dtype.bitsize() / 8).max(1);
            let elem = i / es;
            let bytes = |b: &[u8]| hex(&b[elem * es..(elem + 1) * es]);
            Mismatch {
                message: format!(
                    "tensor `{}`: byte {} differs in a tensor that should be copied unchanged",
                    s.name,
                    first + i as u64
                ),
                tensor: Some(s.name.clone()),
                index: Some(first + elem as u64),
                source_bits: Some(bytes(src)),
                source_value: None,
                expected_bits: Some(bytes(src)),
                found_bits: Some(bytes(got)),
            }
        }
        Expect::Convert(c) => {
            let es = c.src_size() as usize;
            let i = want
                .chunks_exact(2)
                .zip(got.chunks_exact(2))
                .position(|(w, g)| {
                    let (w, g) = (
                        u16::from_le_bytes([w[0], w[1]]),
                        u16::from_le_bytes([g[0], g[1]]),
                    );
                    !(w == g || (loose && is_nan16(c, w) && is_nan16(c, g)))
                })
                .unwrap_or(0);
            let sb = &src[i * es..(i + 1) * es];
            let value = match es {
                2 => half_to_f64(u16::from_le_bytes([sb[0], sb[1]])),
                4 => f32::from_le_bytes([sb[0], sb[1], sb[2], sb[3]]) as f64,
                _ => f64::from_le_bytes(sb.try_into().expect("8 bytes")),
            };
            let w = u16::from_le_bytes([want[2 * i], want[2 * i + 1]]);
            let g = u16::from_le_bytes([got[2 * i], got[2 * i + 1]]);
            Mismatch {
                message: format!(
                    "tensor `{}` element {}: source {} ({value:e}) should give 0x{w:04X}, found 0x{g:04X}",
                    s.name,
                    first + i as u64,
                    hex(sb)
                ),
                tensor: Some(s.name.clone()),
                index: Some(first + i as u64),
                source_bits: Some(hex(sb)),
                source_value: Some(value),
                expected_bits: Some(format!("0x{w:04X}")),
                found_bits: Some(format!("0x{g:04X}")),
            }
        }
    }
}

/// Little-endian element bytes as one hex number.
fn hex(le: &[u8]) -> String {
    let mut s = String::from("0x");
    for b in le.iter().rev() {
        s.push_str(&format!("{b:02X}"));
    }
    s
}

fn half_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let e = ((h >> 10) & 0x1F) as i32;
    let m = (h & 0x3FF) as f64;
    match e {
        0 => sign * m * 2f64.powi(-24),
        31 if m == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        _ => sign * (1.0 + m / 1024.0) * 2f64.powi(e - 15),
    }
}
