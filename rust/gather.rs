//! Tensors that are not one little-endian run of one file, read by gathering: a window of
//! their logical elements (row-major, little-endian) is copied into a buffer, so every pass
//! reads them as it reads a contiguous tensor, a window at a time, in bounded memory.
//!
//! Two kinds (`Gather`), read by the one path `Source::read`:
//! - `View`: a strided or big-endian view of one storage in the tensor's file (a PyTorch
//!   checkpoint's transposed weight), gathered by `torch::gather_releasing`;
//! - `Pieces`: the tensor cut into boxes, each a row-major run of bytes in some file of the
//!   source (a distributed checkpoint's shards: DCP, DeepSpeed ZeRO). Each window copies,
//!   from every piece whose box it intersects, the runs it holds.
//!
//! A `Pieces` is checked when it is made (`Pieces::new`): every box inside the shape, its
//! bytes exactly its elements, no two boxes overlapping and no element left uncovered. The
//! byte ranges are checked against their file when read.

use std::fmt;
use std::ops::Range;

use safetensors::Dtype;

use crate::torch::TensorDesc;

/// How a tensor is gathered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gather {
    /// A strided or big-endian view of a storage in the tensor's own file
    /// (`SourceTensor::input`).
    View(TensorDesc),
    /// Boxes of the tensor held in byte ranges of files of the source.
    Pieces(Pieces),
}

impl From<TensorDesc> for Gather {
    fn from(desc: TensorDesc) -> Gather {
        Gather::View(desc)
    }
}

impl From<Pieces> for Gather {
    fn from(pieces: Pieces) -> Gather {
        Gather::Pieces(pieces)
    }
}

impl Gather {
    /// The strided view, if it is one.
    pub fn view(&self) -> Option<&TensorDesc> {
        match self {
            Gather::View(d) => Some(d),
            Gather::Pieces(_) => None,
        }
    }

    /// Count its files from `by` on: the tensor's source put after `by` other files.
    pub fn offset_inputs(&mut self, by: usize) {
        if let Gather::Pieces(p) = self {
            for q in &mut p.pieces {
                q.input += by;
            }
        }
    }

    /// Every byte range the tensor's elements lie in, with the file it is in (`default`:
    /// the tensor's own file, for a view): for read-ahead advice and page release.
    pub fn spans(&self, default: usize) -> Vec<(usize, Range<u64>)> {
        match self {
            Gather::View(d) => vec![(default, d.span())],
            Gather::Pieces(p) => p
                .pieces
                .iter()
                .map(|q| (q.input, q.bytes.clone()))
                .collect(),
        }
    }
}

/// One box of a tensor and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The file that holds it: an index into `Source::files`.
    pub input: usize,
    /// Its bytes in that file (absolute offsets): the box's elements, row-major over the
    /// box's own sizes, little-endian.
    pub bytes: Range<u64>,
    /// Where the box starts in the tensor, per dimension.
    pub offsets: Vec<u64>,
    /// The box's extent, per dimension.
    pub sizes: Vec<u64>,
}

/// A tensor assembled from boxes in several files: checked to cover its shape exactly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pieces {
    shape: Vec<u64>,
    elem_size: u64,
    /// Non-empty boxes, in the order of their first element in the tensor.
    pieces: Vec<Piece>,
    /// Per piece, how it splits into runs contiguous in both the tensor and the piece.
    runs: Vec<Runs>,
}

/// A box as runs of elements contiguous in the tensor (and in the box's bytes): the box's
/// trailing dimensions that span the whole tensor merge into one run with the dimension
/// before them.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Runs {
    /// The dimensions that index runs: `0..dims` (the run dimension is `dims`).
    dims: usize,
    /// Elements per run.
    len: u64,
    /// Number of runs.
    count: u64,
    /// Tensor element of the first run's first element.
    first: u64,
    /// One past the tensor element of the last run's last element.
    end: u64,
}

/// Why a set of pieces is not a tensor, or a window of one cannot be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PieceProblem {
    /// A dtype of less than a byte per element.
    SubByte { dtype: Dtype },
    /// A box has another number of dimensions than the tensor.
    Rank {
        piece: usize,
        rank: usize,
        want: usize,
    },
    /// A box reaches past the tensor's shape.
    OutOfShape { piece: usize },
    /// A piece's bytes are not its box's elements.
    Length { piece: usize, need: u64, have: u64 },
    /// Two boxes share elements.
    Overlap { a: usize, b: usize },
    /// Elements no box holds.
    Gap { missing: u64 },
    /// A size or offset too large to count.
    Overflow,
    /// A piece's bytes end past its file.
    PastFile { piece: usize, need: u64, have: u64 },
    /// A window outside the tensor, or not of whole elements.
    Window { first: u64, len: usize },
}

impl fmt::Display for PieceProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PieceProblem::SubByte { dtype } => {
                write!(f, "pieces of {dtype}, less than a byte per element")
            }
            PieceProblem::Rank { piece, rank, want } => {
                write!(f, "piece {piece} has {rank} dimensions, the tensor {want}")
            }
            PieceProblem::OutOfShape { piece } => {
                write!(f, "piece {piece} reaches past the tensor's shape")
            }
            PieceProblem::Length { piece, need, have } => {
                write!(f, "piece {piece} holds {have} bytes, its box needs {need}")
            }
            PieceProblem::Overlap { a, b } => write!(f, "pieces {a} and {b} overlap"),
            PieceProblem::Gap { missing } => {
                write!(f, "{missing} elements are in no piece")
            }
            PieceProblem::Overflow => f.write_str("piece sizes overflow"),
            PieceProblem::PastFile { piece, need, have } => write!(
                f,
                "piece {piece} ends at byte {need}, past its file's {have}"
            ),
            PieceProblem::Window { first, len } => write!(
                f,
                "a window of {len} bytes from element {first} is not within the tensor"
            ),
        }
    }
}

/// A `PieceProblem` of the named tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PiecesError {
    pub tensor: String,
    pub problem: PieceProblem,
}

impl fmt::Display for PiecesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tensor `{}`: {}",
            crate::text::esc(&self.tensor),
            self.problem
        )
    }
}

impl std::error::Error for PiecesError {}

fn product(xs: &[u64]) -> Option<u64> {
    xs.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

impl Pieces {
    /// Check `pieces` as the boxes of tensor `name` (`dtype`, `shape`): each inside the
    /// shape, its bytes exactly its elements, together covering every element once. Empty
    /// boxes are dropped.
    pub fn new(
        name: &str,
        dtype: Dtype,
        shape: &[u64],
        pieces: Vec<Piece>,
    ) -> Result<Pieces, PiecesError> {
        let fail = |problem| PiecesError {
            tensor: name.to_string(),
            problem,
        };
        let bits = dtype.bitsize();
        if bits == 0 || !bits.is_multiple_of(8) {
            return Err(fail(PieceProblem::SubByte { dtype }));
        }
        let es = (bits / 8) as u64;
        let numel = product(shape).ok_or_else(|| fail(PieceProblem::Overflow))?;
        numel
            .checked_mul(es)
            .ok_or_else(|| fail(PieceProblem::Overflow))?;
        let mut kept: Vec<(usize, Piece)> = Vec::with_capacity(pieces.len());
        for (i, p) in pieces.into_iter().enumerate() {
            if p.offsets.len() != shape.len() || p.sizes.len() != shape.len() {
                return Err(fail(PieceProblem::Rank {
                    piece: i,
                    rank: p.offsets.len().max(p.sizes.len()),
                    want: shape.len(),
                }));
            }
            let inside = p
                .offsets
                .iter()
                .zip(&p.sizes)
                .zip(shape)
                .all(|((&o, &z), &s)| o.checked_add(z).is_some_and(|e| e <= s));
            if !inside {
                return Err(fail(PieceProblem::OutOfShape { piece: i }));
            }
            // Inside the shape: the product is at most `numel`, and its bytes fit.
            let need = product(&p.sizes).unwrap_or(0) * es;
            let have = p.bytes.end.saturating_sub(p.bytes.start);
            if p.bytes.end < p.bytes.start || have != need {
                return Err(fail(PieceProblem::Length {
                    piece: i,
                    need,
                    have,
                }));
            }
            if need > 0 {
                kept.push((i, p));
            }
        }
        let rank = shape.len();
        let mut runs: Vec<Runs> = kept.iter().map(|(_, p)| runs_of(shape, p)).collect();
        // Sorted by first element: a sweep over dimension 0 finds every overlap.
        let mut order: Vec<usize> = (0..kept.len()).collect();
        order.sort_by_key(|&k| runs[k].first);
        for (x, &a) in order.iter().enumerate() {
            let pa = &kept[a].1;
            for &b in &order[x + 1..] {
                let pb = &kept[b].1;
                // Later boxes start later: once one starts past this one's last element,
                // none of them can share an element with it.
                if runs[b].first >= runs[a].end {
                    break;
                }
                let meet = (0..rank).all(|d| {
                    pa.offsets[d] < pb.offsets[d] + pb.sizes[d]
                        && pb.offsets[d] < pa.offsets[d] + pa.sizes[d]
                });
                if meet {
                    let (i, j) = (kept[a].0.min(kept[b].0), kept[a].0.max(kept[b].0));
                    return Err(fail(PieceProblem::Overlap { a: i, b: j }));
                }
            }
        }
        let covered: u64 = kept
            .iter()
            .map(|(_, p)| product(&p.sizes).unwrap_or(0))
            .sum();
        if covered != numel {
            return Err(fail(PieceProblem::Gap {
                missing: numel - covered,
            }));
        }
        let pieces_sorted: Vec<Piece> = order.iter().map(|&k| kept[k].1.clone()).collect();
        runs = order.iter().map(|&k| runs[k].clone()).collect();
        Ok(Pieces {
            shape: shape.to_vec(),
            elem_size: es,
            pieces: pieces_sorted,
            runs,
        })
    }

    /// Bytes per element.
    pub fn elem_size(&self) -> u64 {
        self.elem_size
    }

    /// Bytes of the tensor written contiguously.
    pub fn nbytes(&self) -> u64 {
        product(&self.shape).unwrap_or(0) * self.elem_size
    }

    /// The (non-empty) pieces, in the order of their first element in the tensor.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// The pieces a window of `count` elements from `first` reads from.
    pub fn touching(&self, first: u64, count: u64) -> impl Iterator<Item = &Piece> + '_ {
        let end = first.saturating_add(count);
        self.pieces
            .iter()
            .zip(&self.runs)
            .filter(move |(p, r)| {
                r.first < end && first < r.end && intersects(p, r, &self.shape, first, end)
            })
            .map(|(p, _)| p)
    }

    /// Copy the elements `[first, first + out.len() / elem_size)` of the tensor, row-major,
    /// into `out`, from `maps` (the mapped files, indexed as `Piece::input`). `release` gets,
    /// per piece read, its file and the byte range this window read of it.
    pub fn gather(
        &self,
        maps: &[&[u8]],
        first: u64,
        out: &mut [u8],
        release: &mut dyn FnMut(usize, Range<u64>),
    ) -> Result<(), PieceProblem> {
        let es = self.elem_size;
        let numel = product(&self.shape).unwrap_or(0);
        let count = out.len() as u64 / es;
        let window = PieceProblem::Window {
            first,
            len: out.len(),
        };
        if !(out.len() as u64).is_multiple_of(es)
            || first.checked_add(count).is_none_or(|e| e > numel)
        {
            return Err(window);
        }
        let end = first + count;
        for (i, (p, r)) in self.pieces.iter().zip(&self.runs).enumerate() {
            if r.end <= first || r.first >= end {
                continue;
            }
            let map = maps.get(p.input).copied().unwrap_or(&[]);
            if p.bytes.end > map.len() as u64 {
                return Err(PieceProblem::PastFile {
                    piece: i,
                    need: p.bytes.end,
                    have: map.len() as u64,
                });
            }
            let (mut read_lo, mut read_hi) = (u64::MAX, 0u64);
            let mut n = first_run_ending_after(&self.shape, p, r, first);
            while n < r.count {
                let at = run_start(&self.shape, p, r, n);
                if at >= end {
                    break;
                }
                let (a, b) = (at.max(first), (at + r.len).min(end));
                let src = p.bytes.start + (n * r.len + (a - at)) * es;
                let len = (b - a) * es;
                let dst = ((a - first) * es) as usize;
                out[dst..dst + len as usize]
                    .copy_from_slice(&map[src as usize..(src + len) as usize]);
                read_lo = read_lo.min(src);
                read_hi = read_hi.max(src + len);
                n += 1;
            }
            if read_lo < read_hi {
                release(p.input, read_lo..read_hi);
            }
        }
        Ok(())
    }
}

/// A run of a tensor's elements, row-major, held contiguously (little-endian) in a file:
/// what a flat partition gives (DeepSpeed ZeRO's fp32 master vectors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatRun {
    /// The file that holds it: an index into `Source::files`.
    pub input: usize,
    /// Its first byte in that file (absolute).
    pub start: u64,
    /// The tensor elements it holds: `first..first + count`, row-major.
    pub first: u64,
    pub count: u64,
}

/// The boxes that make up elements `a..b` (row-major) of a tensor of `shape`, in order:
/// each a row-major run of the tensor (its leading dimensions of size 1, one partial
/// dimension, the trailing ones whole), so its elements in box order are the run's. At most
/// `2N - 1` boxes for `N` dimensions (one for a scalar). `b` is at most the tensor's size.
pub fn flat_boxes(shape: &[u64], a: u64, b: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut out = Vec::new();
    boxes_into(shape, a, b, &[], &mut out);
    out
}

fn boxes_into(shape: &[u64], a: u64, b: u64, lead: &[u64], out: &mut Vec<(Vec<u64>, Vec<u64>)>) {
    if a >= b {
        return;
    }
    let Some((_, rest)) = shape.split_first() else {
        // A scalar: its one element.
        out.push((lead.to_vec(), vec![1; lead.len()]));
        return;
    };
    // Not 0: the tensor holds elements (`b > 0`).
    let inner: u64 = rest.iter().product();
    let (i0, r0, i1, r1) = (a / inner, a % inner, b / inner, b % inner);
    let sub = |i: u64, lo: u64, hi: u64, out: &mut Vec<_>| {
        let mut l = lead.to_vec();
        l.push(i);
        boxes_into(rest, lo, hi, &l, out);
    };
    if i0 == i1 {
        sub(i0, r0, r1, out);
        return;
    }
    let mut i = i0;
    if r0 != 0 {
        sub(i0, r0, inner, out);
        i += 1;
    }
    if i1 > i {
        let mut offsets = lead.to_vec();
        offsets.push(i);
        offsets.extend(std::iter::repeat_n(0, rest.len()));
        let mut sizes = vec![1; lead.len()];
        sizes.push(i1 - i);
        sizes.extend_from_slice(rest);
        out.push((offsets, sizes));
    }
    if r1 != 0 {
        sub(i1, 0, r1, out);
    }
}

impl Pieces {
    /// The tensor `name` made of flat runs (each a row-major range of its elements, held
    /// contiguously in a file), checked as `Pieces::new` checks boxes: every element in
    /// exactly one run.
    pub fn from_runs(
        name: &str,
        dtype: Dtype,
        shape: &[u64],
        runs: &[FlatRun],
    ) -> Result<Pieces, PiecesError> {
        let fail = |problem| PiecesError {
            tensor: name.to_string(),
            problem,
        };
        let bits = dtype.bitsize();
        if bits == 0 || !bits.is_multiple_of(8) {
            return Err(fail(PieceProblem::SubByte { dtype }));
        }
        let es = (bits / 8) as u64;
        let numel = product(shape).ok_or_else(|| fail(PieceProblem::Overflow))?;
        let mut pieces = Vec::new();
        for (i, r) in runs.iter().enumerate() {
            let end = r.first.checked_add(r.count);
            if end.is_none_or(|e| e > numel) {
                return Err(fail(PieceProblem::OutOfShape { piece: i }));
            }
            let mut at = r.start;
            for (offsets, sizes) in flat_boxes(shape, r.first, r.first + r.count) {
                // Inside the shape: no overflow (checked against `numel` above).
                let n = product(&sizes).unwrap_or(0) * es;
                let end = at
                    .checked_add(n)
                    .ok_or_else(|| fail(PieceProblem::Overflow))?;
                pieces.push(Piece {
                    input: r.input,
                    bytes: at..end,
                    offsets,
                    sizes,
                });
                at = end;
            }
        }
        Pieces::new(name, dtype, shape, pieces)
    }
}

/// The runs of a (non-empty, in-shape) box of a tensor of `shape`.
fn runs_of(shape: &[u64], p: &Piece) -> Runs {
    let rank = shape.len();
    if rank == 0 {
        return Runs {
            dims: 0,
            len: 1,
            count: 1,
            first: 0,
            end: 1,
        };
    }
    // The first of the trailing dimensions the box spans whole.
    let mut k = rank;
    while k > 0 && p.offsets[k - 1] == 0 && p.sizes[k - 1] == shape[k - 1] {
        k -= 1;
    }
    let dims = k.saturating_sub(1);
    let inner: u64 = shape[dims + 1..].iter().product();
    let len = p.sizes[dims] * inner;
    let count: u64 = p.sizes[..dims].iter().product();
    let mut r = Runs {
        dims,
        len,
        count,
        first: 0,
        end: 0,
    };
    r.first = run_start(shape, p, &r, 0);
    r.end = run_start(shape, p, &r, count - 1) + len;
    r
}

/// The tensor element where run `n` of box `p` starts.
fn run_start(shape: &[u64], p: &Piece, r: &Runs, n: u64) -> u64 {
    let rank = shape.len();
    if rank == 0 {
        return 0;
    }
    // Tensor strides, innermost first, as we go.
    let mut stride: u64 = shape[r.dims + 1..].iter().product();
    let mut at = p.offsets[r.dims] * stride;
    let mut rem = n;
    for d in (0..r.dims).rev() {
        stride *= shape[d + 1];
        let i = rem % p.sizes[d];
        rem /= p.sizes[d];
        at += (p.offsets[d] + i) * stride;
    }
    at
}

/// The first run of box `p` that ends after tensor element `first` (`r.count` if none):
/// runs start in increasing order, so a binary search.
fn first_run_ending_after(shape: &[u64], p: &Piece, r: &Runs, first: u64) -> u64 {
    let (mut lo, mut hi) = (0u64, r.count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if run_start(shape, p, r, mid) + r.len <= first {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Whether box `p` holds an element of the window `[first, end)` (its span may without).
fn intersects(p: &Piece, r: &Runs, shape: &[u64], first: u64, end: u64) -> bool {
    let n = first_run_ending_after(shape, p, r, first);
    n < r.count && run_start(shape, p, r, n) < end
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A u16 tensor of `shape` whose element i is i (mod 2^16).
    fn whole(shape: &[u64]) -> Vec<u16> {
        (0..product(shape).unwrap()).map(|i| i as u16).collect()
    }

    /// Cut the tensor into `boxes`, each written into the file `file` at the end of what
    /// that file holds so far (after 5 junk bytes): the files and the pieces.
    fn cut(
        shape: &[u64],
        boxes: &[(usize, &[u64], &[u64])],
        files: usize,
    ) -> (Vec<Vec<u8>>, Vec<Piece>) {
        let values = whole(shape);
        let mut maps = vec![vec![0xEE; 5]; files];
        let mut pieces = Vec::new();
        for &(file, offsets, sizes) in boxes {
            let start = maps[file].len() as u64;
            let n = product(sizes).unwrap();
            for k in 0..n {
                // Box index k, row-major over `sizes`, to tensor index.
                let (mut rem, mut lin, mut stride) = (k, 0u64, 1u64);
                for d in (0..shape.len()).rev() {
                    lin += (offsets[d] + rem % sizes[d]) * stride;
                    rem /= sizes[d];
                    stride *= shape[d];
                }
                maps[file].extend_from_slice(&values[lin as usize].to_le_bytes());
            }
            pieces.push(Piece {
                input: file,
                bytes: start..maps[file].len() as u64,
                offsets: offsets.to_vec(),
                sizes: sizes.to_vec(),
            });
            maps[file].extend_from_slice(&[0xDD; 3]);
        }
        (maps, pieces)
    }

    fn read(p: &Pieces, maps: &[Vec<u8>], first: u64, count: u64) -> Vec<u16> {
        let maps: Vec<&[u8]> = maps.iter().map(Vec::as_slice).collect();
        let mut out = vec![0u8; count as usize * 2];
        let mut released = Vec::new();
        p.gather(&maps, first, &mut out, &mut |f, r| released.push((f, r)))
            .unwrap();
        for (f, r) in &released {
            assert!(p
                .pieces
                .iter()
                .any(|q| q.input == *f && q.bytes.start <= r.start && r.end <= q.bytes.end));
        }
        out.chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    }

    /// Every window of every size reads back what the whole tensor holds there.
    fn every_window(shape: &[u64], boxes: &[(usize, &[u64], &[u64])], files: usize) {
        let (maps, pieces) = cut(shape, boxes, files);
        let p = Pieces::new("t", Dtype::U16, shape, pieces).unwrap();
        let want = whole(shape);
        let n = want.len() as u64;
        for first in 0..=n {
            for count in 0..=(n - first) {
                assert_eq!(
                    read(&p, &maps, first, count),
                    want[first as usize..(first + count) as usize],
                    "{shape:?} [{first}, +{count})"
                );
            }
        }
    }

    #[test]
    fn row_bands_in_two_files_read_as_the_whole() {
        every_window(&[6, 5], &[(0, &[0, 0], &[2, 5]), (1, &[2, 0], &[4, 5])], 2);
        // Out of order, and in the same file.
        every_window(&[6, 5], &[(0, &[4, 0], &[2, 5]), (0, &[0, 0], &[4, 5])], 1);
    }

    #[test]
    fn tiles_across_four_files_read_as_the_whole() {
        every_window(
            &[4, 6],
            &[
                (2, &[2, 3], &[2, 3]),
                (0, &[0, 0], &[2, 3]),
                (1, &[0, 3], &[2, 3]),
                (3, &[2, 0], &[2, 3]),
            ],
            4,
        );
        // Uneven tiles of a 3-D tensor, column bands, one dimension, a scalar.
        every_window(
            &[2, 3, 4],
            &[
                (0, &[0, 0, 0], &[2, 1, 4]),
                (1, &[0, 1, 0], &[1, 2, 3]),
                (2, &[0, 1, 3], &[1, 2, 1]),
                (3, &[1, 1, 0], &[1, 2, 4]),
            ],
            4,
        );
        every_window(&[3, 7], &[(0, &[0, 0], &[3, 2]), (1, &[0, 2], &[3, 5])], 2);
        every_window(&[9], &[(1, &[4], &[5]), (0, &[0], &[4])], 2);
        every_window(&[], &[(0, &[], &[])], 1);
        // An empty box is dropped; an empty tensor has nothing to read.
        every_window(&[2, 2], &[(0, &[0, 0], &[2, 2]), (0, &[1, 0], &[0, 2])], 1);
        every_window(&[0, 3], &[], 1);
    }

    #[test]
    fn overlaps_gaps_and_bad_boxes_are_refused_naming_the_tensor() {
        let shape = [4u64, 4];
        let try_ = |boxes: &[(usize, &[u64], &[u64])]| {
            let (_, pieces) = cut(&shape, boxes, 1);
            Pieces::new("model.w", Dtype::U16, &shape, pieces).unwrap_err()
        };
        let e = try_(&[(0, &[0, 0], &[3, 4]), (0, &[2, 0], &[2, 4])]);
        assert_eq!(e.problem, PieceProblem::Overlap { a: 0, b: 1 });
        assert_eq!(e.to_string(), "tensor `model.w`: pieces 0 and 1 overlap");
        // Tiles that meet only in a corner: found though their rows start apart.
        let e = try_(&[
            (0, &[0, 0], &[2, 2]),
            (0, &[0, 2], &[4, 2]),
            (0, &[2, 0], &[2, 2]),
            (0, &[1, 1], &[1, 1]),
        ]);
        assert!(matches!(e.problem, PieceProblem::Overlap { .. }), "{e}");
        let e = try_(&[(0, &[0, 0], &[2, 4]), (0, &[3, 0], &[1, 4])]);
        assert_eq!(e.problem, PieceProblem::Gap { missing: 4 });
        assert!(e.to_string().contains("`model.w`"), "{e}");
        let (_, mut pieces) = cut(&shape, &[(0, &[0, 0], &[4, 4])], 1);
        pieces[0].sizes = vec![4, 5];
        let e = Pieces::new("w", Dtype::U16, &shape, pieces.clone()).unwrap_err();
        assert_eq!(e.problem, PieceProblem::OutOfShape { piece: 0 });
        pieces[0].sizes = vec![4, 4];
        pieces[0].bytes.end -= 2;
        let e = Pieces::new("w", Dtype::U16, &shape, pieces.clone()).unwrap_err();
        assert_eq!(
            e.problem,
            PieceProblem::Length {
                piece: 0,
                need: 32,
                have: 30
            }
        );
        pieces[0].sizes = vec![16];
        let e = Pieces::new("w", Dtype::U16, &shape, pieces.clone()).unwrap_err();
        assert!(matches!(e.problem, PieceProblem::Rank { .. }), "{e}");
        let e = Pieces::new("w", Dtype::F4, &shape, Vec::new()).unwrap_err();
        assert!(matches!(e.problem, PieceProblem::SubByte { .. }), "{e}");
        // Two pieces of a scalar overlap.
        let (_, pieces) = cut(&[], &[(0, &[], &[]), (0, &[], &[])], 1);
        let e = Pieces::new("s", Dtype::U16, &[], pieces).unwrap_err();
        assert_eq!(e.problem, PieceProblem::Overlap { a: 0, b: 1 });
    }

    #[test]
    fn windows_and_files_are_checked_when_read() {
        let (maps, pieces) = cut(&[2, 2], &[(0, &[0, 0], &[1, 2]), (1, &[1, 0], &[1, 2])], 2);
        let p = Pieces::new("t", Dtype::U16, &[2, 2], pieces).unwrap();
        let short: Vec<&[u8]> = vec![&maps[0], &maps[1][..6]];
        let mut out = [0u8; 8];
        let e = p.gather(&short, 0, &mut out, &mut |_, _| {}).unwrap_err();
        assert!(matches!(e, PieceProblem::PastFile { piece: 1, .. }), "{e}");
        let full: Vec<&[u8]> = maps.iter().map(Vec::as_slice).collect();
        let e = p.gather(&full, 1, &mut out, &mut |_, _| {}).unwrap_err();
        assert!(matches!(e, PieceProblem::Window { .. }), "{e}");
        let e = p
            .gather(&full, 0, &mut out[..3], &mut |_, _| {})
            .unwrap_err();
        assert!(matches!(e, PieceProblem::Window { .. }), "{e}");
        // Only the pieces a window needs are touched.
        let touched: Vec<usize> = p.touching(0, 2).map(|q| q.input).collect();
        assert_eq!(touched, [0]);
        let touched: Vec<usize> = p.touching(1, 2).map(|q| q.input).collect();
        assert_eq!(touched, [0, 1]);
    }

    /// The flat (row-major) index of every element of box (`offsets`, `sizes`) of a tensor
    /// of `shape`, in the box's own row-major order.
    fn box_elements(shape: &[u64], offsets: &[u64], sizes: &[u64]) -> Vec<u64> {
        let n = product(sizes).unwrap();
        (0..n)
            .map(|k| {
                let (mut rem, mut lin, mut stride) = (k, 0u64, 1u64);
                for d in (0..shape.len()).rev() {
                    lin += (offsets[d] + rem % sizes[d]) * stride;
                    rem /= sizes[d];
                    stride *= shape[d];
                }
                lin
            })
            .collect()
    }

    fn shape_and_range() -> impl proptest::strategy::Strategy<Value = (Vec<u64>, u64, u64)> {
        use proptest::prelude::*;
        proptest::collection::vec(1u64..6, 0..5).prop_flat_map(|shape| {
            let n = product(&shape).unwrap();
            (Just(shape), 0..=n, 0..=n).prop_map(|(s, x, y)| (s, x.min(y), x.max(y)))
        })
    }

    fn shape_and_cuts() -> impl proptest::strategy::Strategy<Value = (Vec<u64>, Vec<u64>, u64)> {
        use proptest::prelude::*;
        proptest::collection::vec(1u64..5, 0..4).prop_flat_map(|shape| {
            let n = product(&shape).unwrap();
            (
                Just(shape),
                proptest::collection::vec(0..=n, 0..5),
                any::<u64>(),
            )
        })
    }

    proptest::proptest! {
        /// A flat range is at most 2N-1 boxes, in order, each a run of the tensor, together
        /// exactly the range.
        #[test]
        fn flat_ranges_are_a_few_boxes_covering_them_exactly((shape, a, b) in shape_and_range()) {
            let boxes = flat_boxes(&shape, a, b);
            let bound = (2 * shape.len()).saturating_sub(1).max(1);
            proptest::prop_assert!(boxes.len() <= bound, "{} boxes", boxes.len());
            let mut all = Vec::new();
            for (offsets, sizes) in &boxes {
                proptest::prop_assert!(sizes.iter().all(|&z| z > 0));
                proptest::prop_assert!(offsets.iter().zip(sizes).zip(&shape).all(|((o, z), s)| o + z <= *s));
                all.extend(box_elements(&shape, offsets, sizes));
            }
            proptest::prop_assert_eq!(all, (a..b).collect::<Vec<u64>>());
        }

        /// A tensor cut into flat runs at random points, the runs in files in any order,
        /// reads back whole in every window.
        #[test]
        fn flat_runs_in_files_read_as_the_whole(
            (shape, cuts, order) in shape_and_cuts()
        ) {
            let n = product(&shape).unwrap();
            let mut cuts = cuts;
            cuts.push(0);
            cuts.push(n);
            cuts.sort_unstable();
            let values = whole(&shape);
            let mut maps = vec![vec![0xEEu8; 3]; 3];
            let mut runs = Vec::new();
            for (k, w) in cuts.windows(2).enumerate() {
                let file = (k + order as usize) % 3;
                let start = maps[file].len() as u64;
                for i in w[0]..w[1] {
                    maps[file].extend_from_slice(&values[i as usize].to_le_bytes());
                }
                maps[file].push(0xDD);
                runs.push(FlatRun { input: file, start, first: w[0], count: w[1] - w[0] });
            }
            if order % 2 == 1 {
                runs.reverse();
            }
            let p = Pieces::from_runs("t", Dtype::U16, &shape, &runs).unwrap();
            for first in 0..=n {
                for count in 0..=(n - first) {
                    proptest::prop_assert_eq!(
                        read(&p, &maps, first, count),
                        &values[first as usize..(first + count) as usize]
                    );
                }
            }
        }
    }

    #[test]
    fn flat_boxes_of_a_known_range() {
        // Elements 5..27 of a [3, 3, 4] tensor: the rest of row (0, 1), row (0, 2), the
        // slab 1, then (2, 0, 0..3).
        assert_eq!(
            flat_boxes(&[3, 3, 4], 5, 27),
            vec![
                (vec![0, 1, 1], vec![1, 1, 3]),
                (vec![0, 2, 0], vec![1, 1, 4]),
                (vec![1, 0, 0], vec![1, 3, 4]),
                (vec![2, 0, 0], vec![1, 1, 3]),
            ]
        );
        assert_eq!(flat_boxes(&[], 0, 1), vec![(vec![], vec![])]);
        assert!(flat_boxes(&[4, 0], 0, 0).is_empty());
        assert_eq!(flat_boxes(&[7], 2, 5), vec![(vec![2], vec![3])]);
    }

    #[test]
    fn runs_that_overlap_leave_gaps_or_pass_the_end_are_refused() {
        let run = |first, count| FlatRun {
            input: 0,
            start: 0,
            first,
            count,
        };
        let e = Pieces::from_runs("w", Dtype::F32, &[2, 3], &[run(0, 4), run(3, 3)]).unwrap_err();
        assert!(matches!(e.problem, PieceProblem::Overlap { .. }), "{e}");
        let e = Pieces::from_runs("w", Dtype::F32, &[2, 3], &[run(0, 4)]).unwrap_err();
        assert_eq!(e.problem, PieceProblem::Gap { missing: 2 });
        let e = Pieces::from_runs("w", Dtype::F32, &[2, 3], &[run(0, 4), run(4, 3)]).unwrap_err();
        assert_eq!(e.problem, PieceProblem::OutOfShape { piece: 1 });
        assert_eq!(
            e.to_string(),
            "tensor `w`: piece 1 reaches past the tensor's shape"
        );
    }
}
