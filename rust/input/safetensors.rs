//! Open a safetensors file as a `Source`: map it, validate its header, and release a large
//! header's pages once its names and shapes are copied out.

use std::path::Path;

use crate::error::{Error, Result};
use crate::format::Format;
use crate::header::{self, PREFIX};
use crate::source::{InputFile, Source};
use crate::torch::sniff::sniff;

/// Headers from this size on have their pages dropped once parsed (`from_safetensors`).
const LARGE_HEADER: u64 = 4 << 20;

/// The error for a file shorter than a safetensors header's length prefix: an empty file is
/// named as one (it is no format at all), a shorter one as a header too small.
pub(crate) fn too_small(path: &Path, len: u64) -> Error {
    if len == 0 {
        return Error::OtherFormat {
            path: path.to_path_buf(),
            format: Format::Empty,
        };
    }
    Error::invalid_header(
        path,
        format!(
            "header too small: the file is {len} bytes, the header length alone takes {PREFIX}"
        ),
    )
}

impl Source {
    /// Open and validate the safetensors file `path` without reading its data.
    pub fn open(path: &Path) -> Result<Source> {
        let input = InputFile::open(path, PREFIX as u64, |len| too_small(path, len))?;
        Source::from_safetensors(path, input)
    }

    /// Validate the safetensors file `input` (opened as `path`) without reading its data.
    pub fn from_safetensors(path: &Path, mut input: InputFile) -> Result<Source> {
        let header = header::read_header(path, &input.map).map_err(|e| {
            // Another format's reasons to fail as safetensors mislead: name the format.
            match sniff(&input.map) {
                Format::Safetensors | Format::Unknown => e,
                format => Error::OtherFormat {
                    path: path.to_path_buf(),
                    format,
                },
            }
        })?;
        input.base = header.data_start();
        // The names and shapes are copied out: a large header's pages (33.8 MB at 300,000
        // tensors) need not stay resident while the data streams. (A small one is left:
        // its pages share the first data pages.)
        if header.header_len >= LARGE_HEADER {
            input.release_head(header.data_start());
        }
        Ok(Source::from_parts(path, vec![input], header))
    }
}
