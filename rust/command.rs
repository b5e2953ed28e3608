//! One engine entry per command: a `convert`, `inspect` or `verify` of SRC (into DST) with
//! the options given, routed here, once, to one file or to a folder run.
//!
//! The route is the engine's: a folder of files (a Hugging Face folder) and a re-sharding
//! (`max_shard_size`) are folder runs (`folder::run`, `folder::dry`,
//! `folder::verify_folder`); anything else (a file, a DCP or ZeRO folder) is one file
//! (`task::ConvertTask`, `task::InspectTask`, `verify::Verifier`). Before either, SRC is
//! placed (`run::place::source`: a Hub repo id that is not there is refused, with the command
//! that downloads it) and each option set is checked to apply (`given::check_applies`). A
//! front end makes one call per command and gets one of two reports back.

use std::path::{Path, PathBuf};

use crate::convert::Tuning;
use crate::error::{Error, Result, Warning};
use crate::folder::dry::{Dry, DryRun};
use crate::folder::finish::{Converted, FolderReport};
use crate::folder::run::RunTask;
use crate::folder::verify_folder::FolderReport as FolderVerified;
use crate::folder::verify_folder::FolderVerify;
use crate::given::{check_applies, Given, Settings};
use crate::output;
use crate::run::place::{self, SourceKind};
use crate::task::{ConvertTask, InspectTask, Inspection, Said, Task};
use crate::verify::{Verifier, VerifyReport};
#[cfg(test)]
use crate::vocab::OptionName;
use crate::vocab::Target;
use crate::Report;

/// Is a run from `src` with the options `s` a folder run (a folder of files, or a
/// re-sharding)? Refuses a source that is not there but reads like a Hub repo id, and an
/// option set that does not apply to the run.
fn folder_run(src: &Path, s: &Settings) -> Result<bool> {
    let tree = place::source(src, true)? == SourceKind::Tree;
    check_applies(src, &s.set())?;
    Ok(tree || s.max_shard_size.is_some())
}

/// The one file a run of one file writes: the default beside `src`, or the file `dst` names
/// (`place::file_dst`).
fn file_dst(src: &Path, dst: Option<&Path>, to: Target) -> Result<PathBuf> {
    match dst {
        Some(dst) => place::file_dst(src, dst, to),
        None => place::default_dst(src, to, false),
    }
}

/// Each of `Task`'s methods, of whichever task an enum holds (its variants' first field).
macro_rules! either_task {
    ($ty:ident: $($v:ident),*) => {
        impl Task for $ty {
            fn step(&mut self, budget: u64) -> Result<bool> {
                match self { $($ty::$v(t, ..) => t.step(budget)),* }
            }
            fn progress(&self) -> (u64, u64) {
                match self { $($ty::$v(t, ..) => t.progress()),* }
            }
            fn take_warnings(&mut self) -> Vec<Warning> {
                match self { $($ty::$v(t, ..) => t.take_warnings()),* }
            }
            fn file_progress(&self) -> Option<(&std::ffi::OsStr, u64, u64)> {
                match self { $($ty::$v(t, ..) => t.file_progress()),* }
            }
            fn measured(&self) -> bool {
                match self { $($ty::$v(t, ..) => t.measured()),* }
            }
            fn take_said(&mut self) -> Vec<Said> {
                match self { $($ty::$v(t, ..) => t.take_said()),* }
            }
            fn failed(&mut self, e: Error) -> Error {
                match self { $($ty::$v(t, ..) => t.failed(e)),* }
            }
        }
    };
}

/// One file's conversion, then its seal, then its publishing (the commit point), each a
/// step: a stop request between them leaves nothing behind.
pub struct FileRun {
    /// None once published (or dropped unpublished: its output removed).
    task: Option<ConvertTask>,
    sealed: bool,
    done: Option<Report>,
    measured: bool,
    /// Its progress when published.
    total: (u64, u64),
}

impl Task for FileRun {
    fn step(&mut self, budget: u64) -> Result<bool> {
        let task = self.task.as_mut().ok_or(Error::Cancelled)?;
        if !self.sealed {
            if task.step(budget)? {
                task.seal()?;
                self.sealed = true;
            }
            return Ok(false);
        }
        let task = self.task.take().ok_or(Error::Cancelled)?;
        self.total = task.progress();
        self.done = Some(task.publish()?);
        Ok(true)
    }
    fn progress(&self) -> (u64, u64) {
        self.task.as_ref().map_or(self.total, Task::progress)
    }
    fn take_warnings(&mut self) -> Vec<Warning> {
        self.task
            .as_mut()
            .map(Task::take_warnings)
            .unwrap_or_default()
    }
}

/// A `convert`, stepped (`Task`); `finish` gives its report.
pub enum Convert {
    File(Box<FileRun>),
    Folder(Box<RunTask>),
}

either_task!(Convert: File, Folder);

/// What a `convert` did.
pub enum ConvertDone {
    /// One file's report; `measured`: its numerics were asked for.
    File { report: Report, measured: bool },
    /// A folder run's report, and the units it converted.
    Folder(FolderReport, Vec<Converted>),
}

impl Convert {
    /// The conversion of `src` into `dst` (None: the default) with the options `s`, its
    /// first checks made.
    pub fn new(src: &Path, dst: Option<&Path>, s: &Settings, tuning: Tuning) -> Result<Convert> {
        if folder_run(src, s)? {
            return Ok(Convert::Folder(Box::new(RunTask::new(
                src, dst, s, tuning,
            )?)));
        }
        let opts = s.convert(tuning)?;
        let dst = file_dst(src, dst, opts.plan.target)?;
        Ok(Convert::File(Box::new(FileRun {
            task: Some(ConvertTask::new(src, &dst, &opts)?),
            sealed: false,
            done: None,
            measured: opts.numerics,
            total: (0, 0),
        })))
    }

    /// Its report, once every step is done.
    pub fn finish(self) -> Result<ConvertDone> {
        match self {
            Convert::File(run) => Ok(ConvertDone::File {
                report: run.done.expect("finish before the last step"),
                measured: run.measured,
            }),
            Convert::Folder(task) => {
                let (report, converted) = task.finish()?;
                Ok(ConvertDone::Folder(report, converted))
            }
        }
    }
}

/// Where a dry run's output would be written, and whether it fits (`output::space`).
#[derive(Debug, serde::Serialize)]
pub struct Destination {
    pub path: PathBuf,
    pub folder: PathBuf,
    pub free_bytes: u64,
    pub need_bytes: u64,
    pub fits: bool,
}

impl Destination {
    fn of(path: &Path, need: u64) -> Result<Destination> {
        let s = output::space(path, need)?;
        Ok(Destination {
            path: path.to_path_buf(),
            folder: s.folder,
            free_bytes: s.free,
            need_bytes: need,
            fits: s.fits,
        })
    }
}

/// An `inspect`, stepped (`Task`): with DST (the file or folder `convert` would write), a
/// dry run of that `convert`.
pub enum Inspect {
    File(Box<InspectTask>, Option<PathBuf>),
    Folder(Box<DryRun>, Option<PathBuf>),
}

either_task!(Inspect: File, Folder);

/// What an `inspect` found, and with DST, where its output would go.
pub enum Inspected {
    File(Box<Inspection>, Option<Destination>),
    Folder(Box<Dry>, Option<Destination>),
}

impl Inspect {
    /// The inspection of `src` with the options `s`; with `dst`, after every check
    /// `convert` makes before writing, failing as it would.
    pub fn new(src: &Path, dst: Option<&Path>, s: &Settings, tuning: Tuning) -> Result<Inspect> {
        if folder_run(src, s)? {
            let task = DryRun::new(src, dst, s, tuning)?;
            return Ok(Inspect::Folder(Box::new(task), dst.map(Path::to_path_buf)));
        }
        let opts = s.inspect(tuning, dst.is_some())?;
        let dst = dst.map(|d| file_dst(src, Some(d), opts.plan.target));
        let dst = dst.transpose()?;
        let task = InspectTask::new(src, s.scan, &opts, dst.as_deref())?;
        Ok(Inspect::File(Box::new(task), dst))
    }

    /// What it found, once every step is done.
    pub fn finish(self) -> Result<Inspected> {
        let space = |dst: Option<PathBuf>, need| dst.map(|d| Destination::of(&d, need));
        match self {
            Inspect::File(task, dst) => {
                let found = task.finish()?;
                let at = space(dst, found.plan.file_len()).transpose()?;
                Ok(Inspected::File(Box::new(found), at))
            }
            Inspect::Folder(task, dst) => {
                let dry = task.finish()?;
                let at = space(dst, dry.found.rows.output_bytes).transpose()?;
                Ok(Inspected::Folder(Box::new(dry), at))
            }
        }
    }
}

/// A `verify`, stepped (`Task`).
pub enum Verify {
    /// One pair of files; whether numerics were asked for.
    File(Box<Verifier>, bool),
    Folder(Box<FolderVerify>),
}

either_task!(Verify: File, Folder);

/// What a `verify` found.
pub enum Verified {
    /// One pair's report; whether numerics were asked for.
    File(Box<VerifyReport>, bool),
    Folder(Box<FolderVerified>),
}

impl Verify {
    /// The verification of `dst` against `src` with the options `s`. A DST folder that is a
    /// checkpoint to convert is refused (SRC and DST swapped); a folder DST of a file SRC is
    /// the file `convert` writes there, if there is one; a re-sharded stem (`name`) names a
    /// DST folder's files (`place::verify_route`).
    pub fn new(src: &Path, dst: &Path, s: &Settings, tuning: Tuning) -> Result<Verify> {
        place::source(src, true)?;
        let to = s.to.as_ref().map(Given::target).transpose()?;
        let (dst, folder) = place::verify_route(src, dst, to, s.name.is_some())?;
        if folder {
            let task = FolderVerify::new(src, &dst, s, tuning)?;
            return Ok(Verify::Folder(Box::new(task)));
        }
        // One file: the configs, shards and index beside it are checked too (`lone`).
        let lone = Settings {
            lone: true,
            ..s.clone()
        };
        let opts = lone.verify(tuning)?;
        let verifier = Verifier::open(src, &dst, &opts)?;
        Ok(Verify::File(Box::new(verifier), opts.numerics))
    }

    /// What it found, once every step is done.
    pub fn finish(self) -> Result<Verified> {
        match self {
            Verify::File(v, numerics) => Ok(Verified::File(Box::new(v.finish()?), numerics)),
            Verify::Folder(v) => Ok(Verified::Folder(Box::new(v.finish()?))),
        }
    }
}

#[cfg(test)]
mod tests;
