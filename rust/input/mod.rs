//! Open any input stcast reads: a safetensors file, or a PyTorch checkpoint (`torch.save`:
//! `.bin`, `.pt`, `.pth`) made into the same `Source`.
//!
//! A checkpoint is read by `torch` (an allow-listed unpickler: nothing is imported or
//! called), its state dict selected (`InputOptions::key`, the names stripped of
//! `InputOptions::strip_prefix`), and each tensor located in the mapped file: a contiguous
//! little-endian tensor is a byte range, as in a safetensors file; a strided or big-endian
//! view is gathered window by window (`SourceTensor::gather`). Tensors that share a storage
//! (tied weights) are each their own tensor, under their own name. So every pass (convert,
//! scan, verify, inspect) reads a checkpoint exactly as it reads a safetensors file, with
//! the same bounds: the pickle is parsed once (its objects are dropped once the tensors are
//! located), and no tensor data is read before the conversion reads it.
//!
//! Submodules: `safetensors` (the safetensors opener), `folder` (a folder that is a
//! distributed training checkpoint, not a Hugging Face folder), `dcp` and `zero` (the
//! openers of those: torch.distributed.checkpoint and DeepSpeed ZeRO folders). Telling the
//! kinds apart from the bytes is `torch::sniff`'s.

pub mod dcp;
pub mod folder;
pub mod safetensors;
pub mod zero;

use std::path::Path;

use crate::error::{DistProblem, Error, Result, Warning};
use crate::gather::Gather;
use crate::header::{SourceHeader, SourceTensor, PREFIX};
use crate::input::safetensors::too_small;
use crate::naming;
use crate::source::{InputFile, Source};
use crate::text::{esc, format_bytes, name_list};
use crate::torch::{self, Limits, TorchError};
use crate::vocab::{OptionName, WarningKind};

pub use crate::format::Format;
pub use crate::source::Origin;

/// How to read an input that is a PyTorch checkpoint (ignored for none; refused when given
/// for a safetensors file).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InputOptions {
    /// The dotted key of the dict of tensors to convert (`ema`, `state.model`); `None`: the
    /// top level if it holds tensors, else the only dict of tensors.
    pub key: Option<String>,
    /// Prefixes dropped from tensor names (`module.`, `_orig_mod.`), each in turn from what
    /// the one before left (`naming::strip_prefixes`), whatever the input's format.
    pub strip_prefix: Vec<String>,
    /// A checkpoint folder's symlinks that lead outside it are followed (by default they are
    /// refused, naming them: `folder::check_links`).
    pub follow_links: bool,
    /// FP8 targets: fused MoE experts are split per expert where this model's sizes prove
    /// their layout (`experts::split`), once the prefixes are stripped.
    pub experts: Option<crate::experts::Model>,
    /// With `experts`: the run's `keep` patterns. A fused tensor one names is kept as it is,
    /// not split, and its block with it (`experts::split`): convert and verify split alike.
    pub keep: Vec<String>,
}

impl InputOptions {
    /// These options splitting fused experts by `experts`' sizes (None: not split), each
    /// one a pattern of `keep` names left fused (`keep`).
    pub fn with_experts(self, experts: Option<crate::experts::Model>, keep: &[String]) -> Self {
        InputOptions {
            keep: match experts {
                Some(_) => keep.to_vec(),
                None => Vec::new(),
            },
            experts,
            ..self
        }
    }

    /// The option given that only PyTorch checkpoints take (the key of their state dict).
    fn torch_only(&self) -> Option<OptionName> {
        self.key.as_ref().map(|_| OptionName::Key)
    }
}

/// The metadata of every output made from a PyTorch checkpoint, as transformers'
/// `save_pretrained` and safetensors' own `convert.py` write it: older transformers refuse
/// a safetensors file without it.
pub const TORCH_METADATA: (&str, &str) = ("format", "pt");

/// The header of an input read from PyTorch files: `header_len` bytes that are not tensor
/// data, `tensors`, and `TORCH_METADATA`.
pub fn torch_header(header_len: u64, tensors: Vec<SourceTensor>) -> SourceHeader {
    let metadata = (TORCH_METADATA.0.to_string(), TORCH_METADATA.1.to_string());
    SourceHeader {
        header_len,
        metadata: Some(vec![metadata]),
        tensors,
        weight_shapes: Vec::new(),
    }
}

/// The reader's limits for inputs: the pickle may be large (a state dict of 300k tensors),
/// the rest as the reader's defaults.
fn limits() -> Limits {
    Limits::default()
}

impl Source {
    /// Open `path`, a safetensors file or a PyTorch checkpoint, without reading its data.
    /// `opts` selects a checkpoint's state dict; given for a safetensors file, it is refused.
    /// A checkpoint folder (DCP, ZeRO) is recorded in `Source::folders`, and its links are
    /// checked first (`folder::check_links`): one that leads out is never read.
    pub fn open_any(path: &Path, opts: &InputOptions) -> Result<Source> {
        let format = path.is_dir().then(|| folder::folder_format(path)).flatten();
        if let Some(format) = format {
            folder::check_links(path, format, opts.follow_links)?;
        }
        let mut source = Self::open_checked(path, opts)?;
        strip_prefixes(&mut source, &opts.strip_prefix)?;
        if let Some(model) = &opts.experts {
            let keep = crate::pattern::compile_globs(&opts.keep, OptionName::Keep)?;
            let kept = |name: &str| keep.iter().any(|p| crate::pattern::glob_matches(p, name));
            source.pieces = crate::experts::split(&mut source, model, &kept);
            source.experts = (!source.pieces.is_empty()).then(|| model.sizes());
        }
        if format.is_some() {
            source.folders = vec![path.to_path_buf()];
        }
        Ok(source)
    }

    /// `open_any` once a checkpoint folder's links are checked.
    fn open_checked(path: &Path, opts: &InputOptions) -> Result<Source> {
        if path.is_dir() {
            match folder::folder_format(path) {
                Some(Format::Dcp) => return dcp::open(path, opts),
                Some(Format::DcpSafetensors) => {
                    if let Some(option) = opts.torch_only() {
                        return Err(Error::NotACheckpoint {
                            path: path.to_path_buf(),
                            option,
                            format: Format::DcpSafetensors,
                        });
                    }
                    return dcp::open_sharded_safetensors(path, &folder::dcp_shards(path));
                }
                Some(Format::DeepSpeed) => return zero::open(path, opts),
                _ => {}
            }
        }
        if path.extension().is_some_and(|e| e == "distcp") && path.is_file() {
            let folder = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => Path::new(".").to_path_buf(),
            };
            let what = "a rank file of a torch.distributed.checkpoint (DCP) folder: its items \
                        are placed by the folder's .metadata";
            return Err(Error::distributed(
                path,
                None,
                DistProblem::RankFile {
                    what: what.into(),
                    folder,
                },
            ));
        }
        let input = InputFile::open(path, PREFIX as u64, |len| too_small(path, len))?;
        let sniffed = torch::sniff::sniff_parsed(&input.map);
        match sniffed.format {
            Format::TorchZip | Format::TorchLegacy => open_checkpoint(path, input, sniffed, opts),
            _ => {
                let source = Source::from_safetensors(path, input)?;
                if let Some(option) = opts.torch_only() {
                    return Err(Error::NotACheckpoint {
                        path: path.to_path_buf(),
                        option,
                        format: Format::Safetensors,
                    });
                }
                Ok(source)
            }
        }
    }

    /// The input's format: `Format::Safetensors`, or the checkpoint's.
    pub fn format(&self) -> Format {
        self.origin
            .as_ref()
            .map_or(Format::Safetensors, |o| o.format)
    }

    /// Does converting this input change its format (a PyTorch checkpoint)? Then an output
    /// whose tensors all keep their dtype is still worth writing.
    pub fn changes_format(&self) -> bool {
        self.origin.is_some()
    }

    /// What reading the input found worth saying (a checkpoint's entries left out, its
    /// globals outside the allow-list, prefixes to strip that no name starts with).
    pub fn warnings(&self) -> Vec<Warning> {
        let mut out: Vec<Warning> = self
            .origin
            .as_ref()
            .map(Origin::warnings)
            .unwrap_or_default();
        if let (Some(dir), Some(origin)) = (self.folders.first(), &self.origin) {
            let files = folder::companions(dir, origin.format);
            if !files.is_empty() {
                out.push(companions_note(&files));
            }
        }
        out.extend(self.unused_prefixes.iter().map(|p| unmatched_prefix(p)));
        if !self.transposed.is_empty() {
            out.push(crate::experts::transposed_note(&self.transposed));
        }
        out
    }
}

/// The warning for a prefix to strip that no tensor name of the input drops: one per
/// prefix, so that a front end judging several inputs together (a folder's files) keeps
/// those every input gave.
pub fn unmatched_prefix(prefix: &str) -> Warning {
    Warning::new(
        WarningKind::UnmatchedPrefix,
        format!(
            "{{strip_prefix}} {} matches no tensor name (once the prefixes before are \
             stripped): a typo, or another order?",
            name_list([prefix], 1)
        ),
    )
}

/// The note naming the files beside a checkpoint folder's checkpoint, with their sizes
/// (`folder::companions`): the output is one file, and they are not copied beside it.
fn companions_note(files: &[(String, u64)]) -> Warning {
    let sized: Vec<String> = files
        .iter()
        .take(8)
        .map(|(n, size)| format!("`{}` ({})", esc(n), format_bytes(*size)))
        .collect();
    let more = match files.get(8..) {
        Some(rest) if !rest.is_empty() => format!(
            " and {} more ({})",
            rest.len(),
            format_bytes(rest.iter().map(|(_, s)| s).sum())
        ),
        _ => String::new(),
    };
    Warning::new(
        WarningKind::SkippedFiles,
        format!(
            "left out: files beside the checkpoint (its output is one file; copy them \
             beside it, or give the model's config with {{config}}, its dtype set): {}{more}",
            sized.join(", ")
        ),
    )
}

/// Drop `prefixes` from the tensor names of `source`, each in turn from what the one before
/// left (`naming::strip_prefixes`): the same for every input (a safetensors file, a
/// checkpoint's state dict, a DCP or ZeRO folder). Two tensors that would end with one
/// name, or a name that would be `__metadata__`, are refused before anything is written,
/// naming the tensors as they were. A prefix no name drops is recorded for a warning.
/// The `weight_shape` values read with the header follow their tensors' names.
fn strip_prefixes(source: &mut Source, prefixes: &[String]) -> Result<()> {
    if prefixes.is_empty() {
        return Ok(());
    }
    let tensors = &mut source.header.tensors;
    let stripped = |i: usize| naming::strip_prefixes(&tensors[i].name, prefixes);
    let problem = if let Some((first, second)) = naming::first_repeat(tensors.len(), stripped) {
        Some(TorchError::DuplicateName {
            name: stripped(first).to_string(),
            first: tensors[first].name.clone(),
            second: tensors[second].name.clone(),
        })
    } else {
        (0..tensors.len())
            .find(|&i| stripped(i) == "__metadata__")
            .map(|i| TorchError::Tensor {
                name: tensors[i].name.clone(),
                problem: torch::TensorProblem::ReservedName,
            })
    };
    if let Some(error) = problem {
        return Err(Error::Checkpoint {
            path: source.path.clone(),
            error,
        });
    }
    source.unused_prefixes =
        naming::unused_prefixes(tensors.iter().map(|t| t.name.as_str()), prefixes);
    let names = tensors
        .iter_mut()
        .map(|t| &mut t.name)
        .chain(source.header.weight_shapes.iter_mut().map(|(n, _)| n));
    for name in names {
        let at = name.len() - naming::strip_prefixes(name, prefixes).len();
        name.drain(..at);
    }
    Ok(())
}

fn open_checkpoint(
    path: &Path,
    input: InputFile,
    sniffed: torch::sniff::Sniffed,
    opts: &InputOptions,
) -> Result<Source> {
    // The zip's records, read by the sniff, leave the process (not the page cache); the
    // pickle's pages are dropped as the unpickler passes them, long strs once checked.
    input.unmap((0, input.map.len() as u64));
    let base = input.map.as_ptr() as usize;
    let release = |part: &[u8]| {
        let a = (part.as_ptr() as usize).saturating_sub(base) as u64;
        input.unmap((a, a + part.len() as u64));
    };
    let opened =
        sniffed_header(&input.map, sniffed, opts, &release).map_err(|error| Error::Checkpoint {
            path: path.to_path_buf(),
            error,
        })?;
    let (header, origin) = match opened {
        Ok(read) => read,
        Err(what) => {
            let folder = zero::checkpoint_folder(path);
            return Err(Error::distributed(
                path,
                None,
                DistProblem::RankFile { what, folder },
            ));
        }
    };
    // Read: the pages touched since (the names borrowed from the pickle) go too, and the
    // parse's freed heap goes back to the system (Python's objects never reuse it).
    input.unmap((0, input.map.len() as u64));
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of the allocator to the system.
    unsafe {
        libc::malloc_trim(0);
    }
    let mut source = Source::from_parts(path, vec![input], header);
    source.origin = Some(origin);
    Ok(source)
}

/// A checkpoint's selected tensors as a source header, or (`Err`) what it is when it is one
/// rank's file of a DeepSpeed checkpoint (no model on its own).
type Opened = std::result::Result<(SourceHeader, Origin), String>;

/// Read the checkpoint held in `bytes` (the whole mapped file, already sniffed: its zip
/// directory parsed once) and describe its selected tensors as a source header: offsets
/// are absolute (the file's `base` is 0), and the tensors are in the order of their first
/// byte in the file (ties: the pickle's order).
fn sniffed_header(
    bytes: &[u8],
    sniffed: torch::sniff::Sniffed,
    opts: &InputOptions,
    release: &dyn Fn(&[u8]),
) -> std::result::Result<Opened, TorchError> {
    let ck = torch::read_releasing(bytes, sniffed, &limits(), release)?;
    // Told by what it holds, whatever its name: a selection of it would be placeholders or
    // one rank's partition.
    if let Some(what) = zero::rank_file(&ck) {
        return Ok(Err(what));
    }
    // The names it reads (borrowed from the pickle) are copied: their pages may go again.
    let selection = ck.select_releasing(opts.key.as_deref(), &|| release(bytes))?;
    let stored: u64 = ck.storages.iter().map(|s| s.len).sum();
    let (format, globals) = (ck.format, ck.globals.clone());
    // The selection holds what is needed: the parsed pickle, its storages and tensors go
    // before the header is built beside it.
    drop(ck);
    let mut tensors: Vec<SourceTensor> = Vec::with_capacity(selection.tensors.len());
    for t in selection.tensors {
        let mut desc = t.desc;
        if desc.shape.iter().any(|&d| usize::try_from(d).is_err()) {
            return Err(TorchError::Tensor {
                name: t.name,
                problem: torch::TensorProblem::Overflow,
            });
        }
        // Each dimension fits (checked above). The shape's allocation is reused where the
        // description is not kept: nothing new is allocated per tensor once the checkpoint
        // is gone, so nothing lands in the holes it left (which `malloc_trim` returns).
        let to_usize = |d: u64| d as usize;
        let dtype = desc.dtype;
        let (start, end, shape, gather) = match desc.contiguous_range() {
            Some(r) if !desc.big_endian => {
                let shape = std::mem::take(&mut desc.shape).into_iter().map(to_usize);
                (r.start, r.end, shape.collect(), None)
            }
            _ => {
                let start = desc.span().start;
                let end = start.checked_add(desc.nbytes()).ok_or(TorchError::Tensor {
                    name: t.name.clone(),
                    problem: torch::TensorProblem::Overflow,
                })?;
                let shape = desc.shape.iter().copied().map(to_usize).collect();
                (start, end, shape, Some(Box::new(Gather::View(desc))))
            }
        };
        tensors.push(SourceTensor {
            name: t.name,
            dtype,
            shape,
            start,
            end,
            input: 0,
            gather,
        });
    }
    // File order: the read goes front to back (stable: tied tensors keep the pickle's).
    tensors.sort_by_key(|t| t.start);
    // What is not tensor data: the pickle and the archive's records.
    let header = torch_header((bytes.len() as u64).saturating_sub(stored), tensors);
    let origin = Origin {
        format,
        key: selection.key,
        skipped: selection.skipped,
        globals,
        unlisted: selection.placeholders,
    };
    Ok(Ok((header, origin)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_name_what_was_left_out() {
        let o = Origin {
            format: Format::TorchZip,
            key: "model".into(),
            skipped: vec!["epoch".into()],
            globals: Vec::new(),
            unlisted: vec!["numpy.core.multiarray._reconstruct".into(), "a.b".into()],
        };
        let w = o.warnings();
        assert_eq!(w[0].kind, WarningKind::SkippedEntries);
        assert_eq!(
            w[0].text,
            "entry `epoch` of `model` is not a tensor and is left out"
        );
        assert_eq!(w[1].kind, WarningKind::UnlistedGlobals);
        assert!(w[1].text.contains("2 globals"), "{}", w[1].text);
    }
}
