//! One error type for the engine; every message names the file (and tensor) concerned.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Everything that can stop a conversion.
#[derive(Debug)]
pub enum Error {
    /// The input is not a valid safetensors file (or not one we accept).
    Invalid { path: PathBuf, msg: String },
    /// We refuse to do what was asked (destination exists, is the input, ...).
    Refused { path: PathBuf, msg: String },
    /// The destination file system cannot hold the output.
    NoSpace { dir: PathBuf, need: u64, have: u64 },
    /// An operating-system call failed; `what` says which step.
    Io {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
    /// The caller asked us to stop (Ctrl-C, a cancel flag, a failing callback).
    Cancelled,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn invalid(path: &Path, msg: impl Into<String>) -> Self {
        Error::Invalid {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }

    pub fn refused(path: &Path, msg: impl Into<String>) -> Self {
        Error::Refused {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }

    pub fn io(path: &Path, what: &'static str, source: io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    }

    /// A short machine-readable name, used by the JSON output.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Invalid { .. } => "invalid_input",
            Error::Refused { .. } => "refused",
            Error::NoSpace { .. } => "no_space",
            Error::Io { .. } => "io",
            Error::Cancelled => "cancelled",
        }
    }

    /// The file (or folder) the error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Error::Invalid { path, .. } | Error::Refused { path, .. } | Error::Io { path, .. } => {
                Some(path)
            }
            Error::NoSpace { dir, .. } => Some(dir),
            Error::Cancelled => None,
        }
    }
}

/// Bytes in a human unit, for messages.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Invalid { path, msg } | Error::Refused { path, msg } => {
                write!(f, "{}: {msg}", path.display())
            }
            Error::NoSpace { dir, need, have } => write!(
                f,
                "not enough disk space in {}: need {}, have {}",
                dir.display(),
                human_bytes(*need),
                human_bytes(*have)
            ),
            Error::Io { path, what, source } => {
                write!(f, "{}: {what}: {source}", path.display())
            }
            Error::Cancelled => f.write_str("cancelled"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
