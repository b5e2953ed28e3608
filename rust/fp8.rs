//! FP8 E4M3 arithmetic (TEMPORARY naive version; replaced by the fp8k branch's kernels).

use safetensors::tensor::Dtype;

use crate::kernels::{bf16_from_f32, f16_from_f32, f32_from_f16};

/// What FP8 did to the values of a tensor (or part of one): merged across calls.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Fp8Stats {
    pub elements: u64,
    pub max_abs_err: f64,
    pub sum_sq_err: f64,
    pub sum_sq_src: f64,
    pub flushed: u64,
    pub groups: u64,
    pub zero_groups: u64,
}

impl Fp8Stats {
    pub fn merge(&mut self, o: &Fp8Stats) {
        self.elements += o.elements;
        self.max_abs_err = self.max_abs_err.max(o.max_abs_err);
        self.sum_sq_err += o.sum_sq_err;
        self.sum_sq_src += o.sum_sq_src;
        self.flushed += o.flushed;
        self.groups += o.groups;
        self.zero_groups += o.zero_groups;
    }
    pub fn rel_err(&self) -> f64 {
        if self.sum_sq_src > 0.0 {
            (self.sum_sq_err / self.sum_sq_src).sqrt()
        } else {
            0.0
        }
    }
}

pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = (b >> 3) & 0xF;
    let m = b & 7;
    if e == 0xF && m == 7 {
        return f32::NAN.copysign(sign);
    }
    let v = if e == 0 {
        f32::from(m) * 2f32.powi(-9)
    } else {
        (1.0 + f32::from(m) / 8.0) * 2f32.powi(i32::from(e) - 7)
    };
    sign * v
}

pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7E;
    }
    let mut best = 0u8;
    let mut best_d = f64::INFINITY;
    for c in 0u8..0x7F {
        let d = (f64::from(e4m3_to_f32(c)) - f64::from(a)).abs();
        if d < best_d || (d == best_d && c & 1 == 0) {
            best = c;
            best_d = d;
        }
    }
    sign | best
}

fn size(d: Dtype) -> usize {
    match d {
        Dtype::F32 => 4,
        _ => 2,
    }
}

fn get(d: Dtype, b: &[u8], i: usize) -> f32 {
    match d {
        Dtype::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
        Dtype::BF16 => {
            f32::from_bits(u32::from(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])) << 16)
        }
        _ => f32::from_bits(f32_from_f16(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))),
    }
}

fn round(d: Dtype, x: f32) -> f32 {
    match d {
        Dtype::F32 => x,
        Dtype::BF16 => f32::from_bits(u32::from(bf16_from_f32(x.to_bits())) << 16),
        _ => f32::from_bits(f32_from_f16(f16_from_f32(x.to_bits()))),
    }
}

fn put(d: Dtype, b: &mut [u8], i: usize, x: f32) {
    match d {
        Dtype::F32 => b[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes()),
        Dtype::BF16 => {
            b[2 * i..2 * i + 2].copy_from_slice(&bf16_from_f32(x.to_bits()).to_le_bytes())
        }
        _ => b[2 * i..2 * i + 2].copy_from_slice(&f16_from_f32(x.to_bits()).to_le_bytes()),
    }
}

fn eps(d: Dtype) -> f32 {
    match d {
        Dtype::F32 => f32::EPSILON,
        Dtype::BF16 => 2f32.powi(-7),
        _ => 2f32.powi(-10),
    }
}

pub fn has_nonfinite(d: Dtype, src: &[u8]) -> bool {
    (0..src.len() / size(d)).any(|i| !get(d, src, i).is_finite())
}

fn group(d: Dtype, idx: &[usize], src: &[u8], q: &mut [u8], st: &mut Fp8Stats) -> f32 {
    let amax = idx.iter().fold(0f32, |m, &i| m.max(get(d, src, i).abs()));
    let mut s = round(d, amax / 448.0);
    if s == 0.0 {
        s = eps(d);
        st.zero_groups += 1;
    }
    st.groups += 1;
    for &i in idx {
        let w = get(d, src, i);
        let y = round(d, w / s).clamp(-448.0, 448.0);
        let b = e4m3_from_f32(y);
        q[i] = b;
        let back = f64::from(e4m3_to_f32(b)) * f64::from(s);
        let err = (back - f64::from(w)).abs();
        st.elements += 1;
        st.max_abs_err = st.max_abs_err.max(err);
        st.sum_sq_err += err * err;
        st.sum_sq_src += f64::from(w) * f64::from(w);
        if w != 0.0 && e4m3_to_f32(b) == 0.0 {
            st.flushed += 1;
        }
    }
    s
}

pub fn quantize_channel(
    d: Dtype,
    cols: usize,
    src: &[u8],
    q: &mut [u8],
    scales: &mut [u8],
) -> Fp8Stats {
    let mut st = Fp8Stats::default();
    let rows = src.len() / size(d) / cols;
    for r in 0..rows {
        let idx: Vec<usize> = (r * cols..(r + 1) * cols).collect();
        let s = group(d, &idx, src, q, &mut st);
        put(d, scales, r, s);
    }
    st
}

pub fn quantize_band(
    d: Dtype,
    cols: usize,
    src: &[u8],
    q: &mut [u8],
    scales: &mut [u8],
) -> Fp8Stats {
    let mut st = Fp8Stats::default();
    let rows = src.len() / size(d) / cols;
    for (t, c0) in (0..cols).step_by(128).enumerate() {
        let c1 = (c0 + 128).min(cols);
        let idx: Vec<usize> = (0..rows)
            .flat_map(|r| (c0..c1).map(move |c| r * cols + c))
            .collect();
        let s = group(d, &idx, src, q, &mut st);
        put(d, scales, t, s);
    }
    st
}

/// Which scale an element uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    Tensor,
    Channel,
    Block { rows: usize, cols: usize },
}

#[allow(clippy::too_many_arguments)]
pub fn dequantize(
    layout: ScaleLayout,
    s_dtype: Dtype,
    scales: &[u8],
    cols: usize,
    row0: usize,
    q: &[u8],
    target: Dtype,
    dst: &mut [u8],
) {
    let tiles = match layout {
        ScaleLayout::Block { cols: bc, .. } => cols.div_ceil(bc),
        _ => 1,
    };
    for (k, &b) in q.iter().enumerate() {
        let (r, c) = (row0 + k / cols, k % cols);
        let si = match layout {
            ScaleLayout::Tensor => 0,
            ScaleLayout::Channel => r,
            ScaleLayout::Block { rows: br, cols: bc } => (r / br) * tiles + c / bc,
        };
        let s = get(s_dtype, scales, si);
        let v = round(s_dtype, e4m3_to_f32(b) * s);
        put(target, dst, k, v);
    }
}
