//! Tensor descriptions (dtype, shape, strides over a storage in the file) and the strided
//! gather that copies a window of a tensor's logical elements into a buffer.

use std::ops::Range;

use safetensors::Dtype;

use super::dtype::{self, TorchDtype};
use super::error::{TensorProblem, TorchError};
use super::pickle::RawTensor;
use super::Storage;

/// One tensor: a strided view of a storage whose bytes lie at `data_start..data_start +
/// data_len` in the file. Strides and `storage_offset` count elements of `dtype`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    pub dtype: Dtype,
    /// The torch name of the dtype (`float32`, `float8_e4m3fn`, ...).
    pub torch_dtype: &'static str,
    pub shape: Vec<u64>,
    pub stride: Vec<u64>,
    /// Elements from the start of the storage (view) to the tensor's first element.
    pub storage_offset: u64,
    /// Index into [`crate::torch::Checkpoint::storages`]; tensors that share a storage (tied
    /// weights) share this index.
    pub storage: usize,
    /// File offset of the storage (view)'s first byte.
    pub data_start: u64,
    /// Bytes of the storage (view).
    pub data_len: u64,
    /// Whether the storage's numbers are big-endian (`gather` swaps them).
    pub big_endian: bool,
}

/// Checked product of the shape.
fn product(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

impl TensorDesc {
    /// Bytes per element.
    pub fn elem_size(&self) -> u64 {
        (self.dtype.bitsize() / 8) as u64
    }

    /// Number of elements (the product of the shape; 1 for a scalar).
    pub fn numel(&self) -> u64 {
        product(&self.shape).unwrap_or(u64::MAX)
    }

    /// Bytes of the tensor written contiguously (`numel * elem_size`).
    pub fn nbytes(&self) -> u64 {
        self.numel().saturating_mul(self.elem_size())
    }

    /// Whether the elements lie in row-major order, one after another, in the storage (as
    /// torch's `is_contiguous`: dimensions of size 1 may have any stride; empty tensors are
    /// contiguous).
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected = 1u64;
        for (&size, &stride) in self.shape.iter().zip(&self.stride).rev() {
            if size != 1 {
                if stride != expected {
                    return false;
                }
                expected = expected.saturating_mul(size);
            }
        }
        true
    }

    /// The file byte range of a contiguous tensor (empty for an empty tensor), or `None` if
    /// the tensor is not contiguous. Little-endian contiguous tensors can be copied from
    /// here as they are.
    pub fn contiguous_range(&self) -> Option<Range<u64>> {
        if !self.is_contiguous() {
            return None;
        }
        let start = self
            .storage_offset
            .checked_mul(self.elem_size())
            .and_then(|o| o.checked_add(self.data_start))?;
        Some(start..start.checked_add(self.nbytes())?)
    }

    /// The file byte range that holds every element of the tensor (for read-ahead advice);
    /// empty for an empty tensor.
    pub fn span(&self) -> Range<u64> {
        let es = self.elem_size();
        let at = |elem: u64| elem.checked_mul(es)?.checked_add(self.data_start);
        let range = match self.last_element() {
            Ok(Some(last)) => at(self.storage_offset).zip(last.checked_add(1).and_then(at)),
            _ => None,
        };
        range.map_or(self.data_start..self.data_start, |(lo, hi)| lo..hi)
    }

    /// The storage index of the last element, `None` for an empty tensor.
    fn last_element(&self) -> Result<Option<u64>, TensorProblem> {
        if self.shape.len() != self.stride.len() {
            return Err(TensorProblem::BadArgs {
                func: "a tensor description",
                reason: "shape and stride differ in length".into(),
            });
        }
        last_element(self.storage_offset, &self.shape, &self.stride)
    }

    /// Check the view against its storage: the last element must lie inside it.
    pub fn validate(&self) -> Result<(), TensorProblem> {
        let es = self.elem_size();
        let available = self.data_len / es.max(1);
        if let Some(last) = self.last_element()? {
            if last >= available {
                return Err(TensorProblem::OutOfBounds { last, available });
            }
        }
        product(&self.shape)
            .and_then(|n| n.checked_mul(es))
            .ok_or(TensorProblem::Overflow)?;
        self.data_start
            .checked_add(self.data_len)
            .ok_or(TensorProblem::Overflow)?;
        Ok(())
    }
}

/// `offset + Σ (size - 1) · stride`, or `None` if some size is 0.
fn last_element(offset: u64, shape: &[u64], stride: &[u64]) -> Result<Option<u64>, TensorProblem> {
    if shape.contains(&0) {
        return Ok(None);
    }
    let mut last = offset;
    for (&size, &st) in shape.iter().zip(stride) {
        last = (size - 1)
            .checked_mul(st)
            .and_then(|x| last.checked_add(x))
            .ok_or(TensorProblem::Overflow)?;
    }
    Ok(Some(last))
}

/// Turn a pickled tensor into a checked description, now that storages are located.
pub(crate) fn describe(
    raw: RawTensor,
    storages: &[Storage],
    max_ndim: usize,
) -> Result<TensorDesc, TensorProblem> {
    let t: &TorchDtype = raw.dtype;
    let Some(dtype) = t.safetensors else {
        return Err(TensorProblem::UnsupportedDtype {
            dtype: t.name.to_string(),
        });
    };
    if raw.shape.len() > max_ndim {
        return Err(TensorProblem::TooManyDims {
            ndim: raw.shape.len(),
            limit: max_ndim,
        });
    }
    let Some(s) = storages.get(raw.storage.storage) else {
        return Err(TensorProblem::BadArgs {
            func: "a tensor rebuild",
            reason: "it names an unknown storage".into(),
        });
    };
    if let Some(c) = raw.storage.conflict {
        return Err(TensorProblem::StorageConflict {
            key: s.key.to_string(),
            conflict: Box::new(c),
            legacy: !s.in_zip,
        });
    }
    // Views (legacy files) were checked against their storage when the storage was located.
    let start = s.offset.checked_add(raw.storage.offset);
    let len = raw.storage.len.unwrap_or(s.len);
    let Some(data_start) = start else {
        return Err(TensorProblem::Overflow);
    };
    let desc = TensorDesc {
        dtype,
        torch_dtype: t.name,
        shape: raw.shape,
        stride: raw.stride,
        storage_offset: raw.offset,
        storage: raw.storage.storage,
        data_start,
        data_len: len,
        big_endian: s.big_endian,
    };
    desc.validate()?;
    Ok(desc)
}

/// Drop size-1 dimensions and merge dimensions that step through memory as one.
fn coalesce(shape: &[u64], stride: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let mut sizes: Vec<u64> = Vec::with_capacity(shape.len());
    let mut strides: Vec<u64> = Vec::with_capacity(shape.len());
    for (&size, &st) in shape.iter().zip(stride) {
        if size == 1 {
            continue;
        }
        match (sizes.last_mut(), strides.last_mut()) {
            // The previous (outer) dimension steps exactly over this one: merge.
            (Some(ps), Some(pst)) if *pst == st.saturating_mul(size) => {
                *ps *= size;
                *pst = st;
            }
            _ => {
                sizes.push(size);
                strides.push(st);
            }
        }
    }
    (sizes, strides)
}

/// Copy the logical elements `[first_elem, first_elem + out.len() / elem_size)` of `t`, in
/// row-major order, from `map` (the whole mapped file) into `out`, as little-endian numbers.
///
/// Any window of any valid tensor may be asked for, so a caller can go window by window in
/// bounded memory. Contiguous little-endian windows are one `memcpy`. Storages need not be
/// aligned. The descriptor is checked again first, so a hand-made one cannot read outside
/// `map`.
pub fn gather(
    map: &[u8],
    t: &TensorDesc,
    first_elem: u64,
    out: &mut [u8],
) -> Result<(), TorchError> {
    gather_releasing(map, t, first_elem, out, &mut |_| {})
}

/// Elements of the innermost dimension gathered per block when that dimension is strided
/// (see `gather_releasing`).
pub const GATHER_BLOCK: usize = 64;

/// Bytes of storage a run of a strided one-dimensional view spans before it is released
/// (see `gather_blocked`).
const SPAN_BLOCK: usize = 1 << 20;

/// `gather`, calling `release` with each byte range of `map` it is done with, while it
/// gathers. A view whose innermost dimension is strided (a transposed weight) reads one
/// element of many storage rows for every output row: walked row by row, one window would
/// map the whole storage (each fault maps its neighbours too). It is walked in blocks of
/// `GATHER_BLOCK` columns instead, every output row of the window for one block, then the
/// block's storage range released: a transposed storage is mapped a block of its rows at
/// a time, whatever its size.
pub fn gather_releasing(
    map: &[u8],
    t: &TensorDesc,
    first_elem: u64,
    out: &mut [u8],
    release: &mut dyn FnMut(Range<u64>),
) -> Result<(), TorchError> {
    gather_blocked(map, t, first_elem, out, GATHER_BLOCK, release)
}

fn gather_blocked(
    map: &[u8],
    t: &TensorDesc,
    first_elem: u64,
    out: &mut [u8],
    block: usize,
    release: &mut dyn FnMut(Range<u64>),
) -> Result<(), TorchError> {
    let es = t.elem_size();
    if es == 0 || !(out.len() as u64).is_multiple_of(es) {
        return Err(TorchError::GatherLength {
            len: out.len(),
            elem_size: es,
        });
    }
    let count = out.len() as u64 / es;
    let numel = product(&t.shape).ok_or(TorchError::GatherInvalid {
        problem: TensorProblem::Overflow,
    })?;
    if first_elem.checked_add(count).is_none_or(|end| end > numel) {
        return Err(TorchError::GatherRange {
            first: first_elem,
            count,
            numel,
        });
    }
    if count == 0 {
        return Ok(());
    }
    t.validate()
        .map_err(|problem| TorchError::GatherInvalid { problem })?;
    let end = t.data_start + t.data_len;
    if end > map.len() as u64 {
        return Err(TorchError::GatherMap {
            need: end,
            have: map.len() as u64,
        });
    }
    // From here on every element index lies in [storage_offset, last] and every byte in
    // the storage, which lies in `map`: the arithmetic below cannot overflow or go out.
    let data = &map[t.data_start as usize..end as usize];
    let es = es as usize;
    let (sizes, strides) = coalesce(&t.shape, &t.stride);
    let base = t.storage_offset as usize;
    if sizes.is_empty() || (sizes.len() == 1 && strides[0] == 1) {
        // One element, or one contiguous run.
        let from = (base + first_elem as usize) * es;
        out.copy_from_slice(&data[from..from + out.len()]);
    } else if sizes.len() > 1
        && strides[sizes.len() - 1] != 1
        && sizes[sizes.len() - 1] > block as u64
    {
        let at = |elem: usize| t.data_start + (elem * es) as u64;
        let mut done = |lo: usize, hi: usize| release(at(lo)..at(hi));
        blocked(
            data, es, base, &sizes, &strides, first_elem, out, block, &mut done,
        );
    } else if sizes.len() == 1 && strides[0] > 1 && sizes[0] > block as u64 {
        // One strided dimension (`x[::k]`): a window of its elements spans k times its
        // bytes of storage, a page per element once k is large. Copied in runs spanning
        // about `SPAN_BLOCK` bytes of storage, each released after it is read.
        let run = (SPAN_BLOCK / (strides[0] as usize * es)).max(block);
        let at = |elem: usize| t.data_start + (elem * es) as u64;
        let mut done = |lo: usize, hi: usize| release(at(lo)..at(hi));
        blocked(
            data, es, base, &sizes, &strides, first_elem, out, run, &mut done,
        );
    } else {
        strided(data, es, base, &sizes, &strides, first_elem, out);
    }
    if t.big_endian {
        let unit = dtype::swap_unit(t.dtype);
        if unit > 1 {
            for chunk in out.chunks_exact_mut(unit) {
                chunk.reverse();
            }
        }
    }
    Ok(())
}

/// The storage element index of the logical element `lin` (coalesced sizes and strides).
fn offset_of(base: usize, sizes: &[u64], strides: &[u64], lin: u64) -> usize {
    let mut rem = lin;
    let mut offset = base;
    for d in (0..sizes.len()).rev() {
        offset += ((rem % sizes[d]) * strides[d]) as usize;
        rem /= sizes[d];
    }
    offset
}

/// `strided` for an innermost dimension that is strided and longer than `block`: the
/// window's rows are walked one block of columns at a time, and after each block `done`
/// gets the element range (lowest, one past the highest) it read.
#[allow(clippy::too_many_arguments)]
fn blocked(
    data: &[u8],
    es: usize,
    base: usize,
    sizes: &[u64],
    strides: &[u64],
    first: u64,
    out: &mut [u8],
    block: usize,
    done: &mut dyn FnMut(usize, usize),
) {
    let inner = sizes[sizes.len() - 1];
    let inner_stride = strides[sizes.len() - 1] as usize;
    let count = (out.len() / es) as u64;
    let (first_row, last_row) = (first / inner, (first + count - 1) / inner);
    let mut c0 = 0u64;
    while c0 < inner {
        let c1 = (c0 + block as u64).min(inner);
        let (mut lo, mut hi) = (usize::MAX, 0usize);
        for row in first_row..=last_row {
            // This row's columns inside the window, and inside the block.
            let row_start = row * inner;
            let a = first.max(row_start + c0);
            let b = (first + count).min(row_start + c1);
            if a >= b {
                continue;
            }
            let offset = offset_of(base, sizes, strides, a);
            let n = (b - a) as usize;
            lo = lo.min(offset);
            hi = hi.max(offset + (n - 1) * inner_stride + 1);
            let at = ((a - first) as usize) * es;
            copy_strided(&mut out[at..at + n * es], data, es, offset, inner_stride);
        }
        if lo < hi {
            done(lo, hi);
        }
        c0 = c1;
    }
}

/// The general case of `gather`: walk the (coalesced) index space from `first`.
fn strided(
    data: &[u8],
    es: usize,
    base: usize,
    sizes: &[u64],
    strides: &[u64],
    first: u64,
    out: &mut [u8],
) {
    let nd = sizes.len();
    // The multi-index of `first`, and the element offset it points at.
    let mut idx = vec![0u64; nd];
    let mut rem = first;
    for d in (0..nd).rev() {
        idx[d] = rem % sizes[d];
        rem /= sizes[d];
    }
    let mut offset = base
        + idx
            .iter()
            .zip(strides)
            .map(|(&i, &s)| (i * s) as usize)
            .sum::<usize>();
    let inner = sizes[nd - 1];
    let inner_stride = strides[nd - 1] as usize;
    let mut written = 0usize;
    while written < out.len() {
        // Along the innermost dimension, from idx[nd-1] to its end or the window's end.
        let left_in_row = (inner - idx[nd - 1]) as usize;
        let n = left_in_row.min((out.len() - written) / es);
        let dst = &mut out[written..written + n * es];
        if inner_stride == 1 {
            dst.copy_from_slice(&data[offset * es..(offset + n) * es]);
        } else {
            copy_strided(dst, data, es, offset, inner_stride);
        }
        written += n * es;
        if written == out.len() {
            break;
        }
        // Step to the start of the next row: carry through the outer dimensions.
        offset -= idx[nd - 1] as usize * inner_stride;
        idx[nd - 1] = 0;
        let mut d = nd - 1;
        loop {
            // `written < out.len()` means a next element exists, so some outer dim carries.
            d -= 1;
            idx[d] += 1;
            offset += strides[d] as usize;
            if idx[d] < sizes[d] {
                break;
            }
            offset -= (idx[d] * strides[d]) as usize;
            idx[d] = 0;
        }
    }
}

/// Copy `dst.len() / es` elements of `es` bytes, `stride` elements apart from `offset`
/// (fixed-size copies for the usual widths).
fn copy_strided(dst: &mut [u8], data: &[u8], es: usize, offset: usize, stride: usize) {
    match es {
        1 => step::<1>(dst, data, offset, stride),
        2 => step::<2>(dst, data, offset, stride),
        4 => step::<4>(dst, data, offset, stride),
        8 => step::<8>(dst, data, offset, stride),
        _ => {
            for (k, d) in dst.chunks_exact_mut(es).enumerate() {
                let at = (offset + k * stride) * es;
                d.copy_from_slice(&data[at..at + es]);
            }
        }
    }
}

/// Copy `dst.len() / N` elements of `N` bytes, `stride` elements apart from `offset`.
#[inline]
fn step<const N: usize>(dst: &mut [u8], data: &[u8], offset: usize, stride: usize) {
    for (k, d) in dst.chunks_exact_mut(N).enumerate() {
        let at = (offset + k * stride) * N;
        let src: &[u8; N] = data[at..at + N].try_into().unwrap_or(&[0; N]);
        d.copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(dtype: Dtype, shape: &[u64], stride: &[u64], offset: u64, len: u64) -> TensorDesc {
        TensorDesc {
            dtype,
            torch_dtype: "test",
            shape: shape.to_vec(),
            stride: stride.to_vec(),
            storage_offset: offset,
            storage: 0,
            data_start: 3,
            data_len: len,
            big_endian: false,
        }
    }

    /// A storage of `n` u16 elements whose values are their indices, after 3 bytes of junk.
    fn map16(n: u64) -> Vec<u8> {
        let mut m = vec![0xaa; 3];
        for i in 0..n {
            m.extend_from_slice(&(i as u16).to_le_bytes());
        }
        m
    }

    /// The reference: element by element through the strides.
    fn naive(t: &TensorDesc) -> Vec<u16> {
        let n = t.numel();
        let mut out = Vec::new();
        for lin in 0..n {
            let mut rem = lin;
            let mut off = t.storage_offset;
            for d in (0..t.shape.len()).rev() {
                off += (rem % t.shape[d]) * t.stride[d];
                rem /= t.shape[d];
            }
            out.push(off as u16);
        }
        out
    }

    fn gathered(map: &[u8], t: &TensorDesc, first: u64, count: u64) -> Vec<u16> {
        let mut out = vec![0u8; (count * 2) as usize];
        gather(map, t, first, &mut out).unwrap();
        out.chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    }

    #[test]
    fn blocked_gathers_equal_the_reference_and_release_what_they_read() {
        // Strided innermost dimensions longer than the block: transposed, permuted, with
        // an offset, a size-1 dimension, a broadcast row, one dimension; every window,
        // blocks of 1 to 4.
        let map = map16(400);
        let cases: &[(&[u64], &[u64], u64)] = &[
            (&[3, 7], &[1, 3], 0),
            (&[5, 6], &[1, 5], 2),
            (&[2, 3, 5], &[1, 2, 6], 0),
            (&[3, 2, 5], &[2, 1, 6], 1),
            (&[4, 1, 6], &[1, 50, 4], 3),
            (&[3, 6], &[0, 2], 0),
            // One strided dimension (`x[::k]`), longer than the block.
            (&[9], &[3], 0),
            (&[7], &[2], 5),
            (&[6], &[40], 1),
        ];
        for &(shape, stride, off) in cases {
            let t = desc(Dtype::U16, shape, stride, off, 800);
            t.validate().unwrap();
            let want = naive(&t);
            let n = want.len() as u64;
            for block in 1..=4 {
                for first in 0..n {
                    for count in 1..=(n - first) {
                        let mut out = vec![0u8; (count * 2) as usize];
                        let mut released: Vec<Range<u64>> = Vec::new();
                        gather_blocked(&map, &t, first, &mut out, block, &mut |r| released.push(r))
                            .unwrap();
                        let got: Vec<u16> = out
                            .chunks(2)
                            .map(|c| u16::from_le_bytes([c[0], c[1]]))
                            .collect();
                        let what =
                            format!("{shape:?} {stride:?} +{off} [{first}, +{count}) /{block}");
                        assert_eq!(
                            got,
                            want[first as usize..(first + count) as usize],
                            "{what}"
                        );
                        // Every element read lies in a range released (the values are the
                        // storage indices: element i is at byte 3 + 2i).
                        for &v in &got {
                            let at = 3 + 2 * v as u64;
                            assert!(
                                released.iter().any(|r| r.start <= at && at + 2 <= r.end),
                                "{what}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_window_of_assorted_views() {
        let map = map16(200);
        let cases: &[(&[u64], &[u64], u64)] = &[
            (&[], &[], 5),
            (&[6], &[1], 0),
            (&[2, 3], &[3, 1], 0),
            (&[3, 2], &[1, 3], 0),        // transposed
            (&[2, 3], &[3, 1], 7),        // sliced
            (&[4, 1, 3], &[3, 99, 1], 1), // size-1 dim with odd stride
            (&[3, 4], &[0, 1], 2),        // broadcast (stride 0)
            (&[2, 3, 4], &[1, 2, 6], 0),  // fully reversed strides
            (&[2, 2, 2, 3], &[40, 12, 5, 2], 1),
            (&[5], &[7], 3),
            (&[0, 3], &[3, 1], 0),
            (&[1], &[0], 9),
        ];
        for &(shape, stride, off) in cases {
            let t = desc(Dtype::U16, shape, stride, off, 400);
            t.validate().unwrap();
            let want = naive(&t);
            let n = want.len() as u64;
            for first in 0..=n {
                for count in 0..=(n - first) {
                    let got = gathered(&map, &t, first, count);
                    assert_eq!(
                        got,
                        want[first as usize..(first + count) as usize],
                        "{shape:?} {stride:?} +{off} [{first}, +{count})"
                    );
                }
            }
            assert_eq!(
                t.is_contiguous(),
                shape.contains(&0) || naive(&t).windows(2).all(|w| w[1] == w[0] + 1)
            );
        }
    }

    #[test]
    fn contiguity_and_ranges() {
        let t = desc(Dtype::F32, &[2, 3], &[3, 1], 2, 40);
        assert!(t.is_contiguous());
        assert_eq!(t.contiguous_range(), Some(11..35));
        assert_eq!(t.span(), 11..35);
        let tr = desc(Dtype::F32, &[3, 2], &[1, 3], 0, 24);
        assert!(!tr.is_contiguous());
        assert_eq!(tr.contiguous_range(), None);
        assert_eq!(tr.span(), 3..27);
        let empty = desc(Dtype::F32, &[0, 5], &[5, 1], 0, 0);
        assert!(empty.is_contiguous());
        assert_eq!(empty.contiguous_range(), Some(3..3));
        assert_eq!(empty.span(), 3..3);
        gather(&[], &empty, 0, &mut []).unwrap();
    }

    #[test]
    fn bounds() {
        // The last element of a broadcast view is what counts, not numel.
        let t = desc(Dtype::F32, &[1000, 4], &[0, 1], 0, 16);
        t.validate().unwrap();
        let t = desc(Dtype::F32, &[2, 4], &[4, 1], 1, 32);
        assert_eq!(
            t.validate().unwrap_err(),
            TensorProblem::OutOfBounds {
                last: 8,
                available: 8
            }
        );
        let t = desc(Dtype::F32, &[u64::MAX, 2], &[2, 1], 0, 32);
        assert_eq!(t.validate().unwrap_err(), TensorProblem::Overflow);
        let t = desc(Dtype::F32, &[1 << 40, 1 << 40], &[0, 0], 0, 4);
        assert_eq!(t.validate().unwrap_err(), TensorProblem::Overflow);
    }

    #[test]
    fn gather_refuses_bad_requests() {
        let map = map16(10);
        let t = desc(Dtype::U16, &[10], &[1], 0, 20);
        let mut out = [0u8; 3];
        assert!(matches!(
            gather(&map, &t, 0, &mut out),
            Err(TorchError::GatherLength { .. })
        ));
        let mut out = [0u8; 4];
        assert!(matches!(
            gather(&map, &t, 9, &mut out),
            Err(TorchError::GatherRange { .. })
        ));
        assert!(matches!(
            gather(&map[..10], &t, 0, &mut out),
            Err(TorchError::GatherMap { .. })
        ));
        let bad = desc(Dtype::U16, &[11], &[1], 0, 20);
        assert!(matches!(
            gather(&map, &bad, 0, &mut out),
            Err(TorchError::GatherInvalid { .. })
        ));
    }

    #[test]
    fn big_endian_swaps_per_unit() {
        let mut map = vec![0u8; 3];
        map.extend_from_slice(&1.5f32.to_be_bytes());
        map.extend_from_slice(&(-2.0f32).to_be_bytes());
        let mut t = desc(Dtype::C64, &[], &[], 0, 8);
        t.big_endian = true;
        let mut out = [0u8; 8];
        gather(&map, &t, 0, &mut out).unwrap();
        assert_eq!(out[..4], 1.5f32.to_le_bytes());
        assert_eq!(out[4..], (-2.0f32).to_le_bytes());
        let mut t = desc(Dtype::F64, &[], &[], 0, 8);
        t.big_endian = true;
        gather(&map, &t, 0, &mut out).unwrap();
        let mut want = map[3..11].to_vec();
        want.reverse();
        assert_eq!(out.to_vec(), want);
    }
}
