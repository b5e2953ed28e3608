//! Stepping a task for a front end (`Driver`): the rules of what its caller is told between
//! steps, and of how a stop request and a failure meet, written once for every command.
//!
//! The caller (`Caller`: the Python adapter's callbacks) says only how to tell it things
//! and how to step away from it (the GIL released); the driver decides when:
//! - between steps, first the warnings a folder run said (with their path), then a stop
//!   request (`Caller::stop`), then the task's warnings, then its progress, then a stop
//!   request again (one a callback made: the next step may be the commit point);
//! - progress reaches the caller once per value: a one-file task's `(total, total)` once,
//!   and a folder run's (`metered`) only once a file has begun, each file's own progress
//!   once per value, and `(total, total)` once at the end, also when nothing was left;
//! - once the last step is done, what is left is told, but a stop request no longer stops
//!   the task: a folder run's outputs are published then, its manifests gone;
//! - a step that fails: a stop request that came meanwhile wins (the EINTR it caused is not
//!   the news), unless the failure comes after the commit point, which must be told as
//!   such; then the task's own handling of its failure (`Task::failed`: a folder run rolls
//!   back what it added), then what it said meanwhile, then the failure.

use std::ffi::{OsStr, OsString};

use super::Task;
use crate::error::{Error, Result, Warning};

/// A front end's side of a stepped task: told what the task says, asked for stop requests.
/// Each may fail with the front end's own failure (an exception a callback raised).
pub trait Caller {
    /// The front end's failure.
    type Failure;
    /// A stop request (a signal, a cancel flag) as a failure; Ok: none.
    fn stop(&mut self) -> std::result::Result<(), Self::Failure>;
    /// A warning, with the file it is about (a folder run's).
    fn warn(&mut self, w: &Warning, at: Option<&OsStr>) -> std::result::Result<(), Self::Failure>;
    /// Bytes done and in all.
    fn progress(&mut self, done: u64, total: u64) -> std::result::Result<(), Self::Failure>;
    /// A folder run's file in progress: its bytes done and in all.
    fn file_progress(
        &mut self,
        rel: &OsStr,
        done: u64,
        total: u64,
    ) -> std::result::Result<(), Self::Failure>;
    /// Run `f` away from the front end (the GIL released); Err: it panicked, this message.
    fn away<T: Send>(&mut self, f: impl FnOnce() -> T + Send) -> std::result::Result<T, String>;
    /// An engine error as the front end's failure.
    fn failure(&mut self, e: Error) -> Self::Failure;
    /// A panic's message as the front end's failure.
    fn panicked(&mut self, message: String) -> Self::Failure;
}

/// Steps tasks for a `Caller`, telling it each value once.
pub struct Driver<C: Caller> {
    pub caller: C,
    /// A folder run's progress: told per file (`Task::file_progress`).
    pub metered: bool,
    /// `(total, total)` was told: the visits after the last step (sealing, publishing) do
    /// not tell it again, so that a caller hears of the end once.
    ended: bool,
    /// What a metered run told last: a file's end, told again as the next step begins,
    /// reaches the caller once.
    told: Option<(u64, u64)>,
    file_told: Option<(OsString, u64, u64)>,
}

type Told<C> = std::result::Result<(), <C as Caller>::Failure>;

impl<C: Caller> Driver<C> {
    pub fn new(caller: C) -> Driver<C> {
        Driver {
            caller,
            metered: false,
            ended: false,
            told: None,
            file_told: None,
        }
    }

    /// Step `task` to its end, `step` source bytes at a time, visiting the caller between
    /// steps (the module's rules).
    pub fn drive(&mut self, task: &mut (impl Task + Send), step: u64) -> Told<C> {
        loop {
            self.visit(task, false)?;
            let e = match self.caller.away(|| task.step(step)) {
                Ok(Ok(true)) => return self.visit(task, true),
                Ok(Ok(false)) => continue,
                Ok(Err(e)) => e,
                Err(panic) => return Err(self.caller.panicked(panic)),
            };
            self.stopped(&e)?;
            let e = match self.caller.away(|| task.failed(e)) {
                Ok(e) => e,
                Err(panic) => return Err(self.caller.panicked(panic)),
            };
            self.tell_said(task)?;
            return Err(self.caller.failure(e));
        }
    }

    /// Run `f` away from the caller: its failure told as `drive` tells a step's.
    pub fn run<T: Send>(
        &mut self,
        f: impl FnOnce() -> Result<T> + Send,
    ) -> std::result::Result<T, C::Failure> {
        let e = match self.caller.away(f) {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => e,
            Err(panic) => return Err(self.caller.panicked(panic)),
        };
        self.stopped(&e)?;
        Err(self.caller.failure(e))
    }

    /// A stop request that came while `e` was failing wins over it, but not over a failure
    /// after the commit point.
    fn stopped(&mut self, e: &Error) -> Told<C> {
        match e {
            Error::AfterCommit { .. } => Ok(()),
            _ => self.caller.stop(),
        }
    }

    /// Between steps; `end`: the task is done, and a stop request no longer stops it.
    fn visit(&mut self, task: &mut impl Task, end: bool) -> Told<C> {
        self.tell_said(task)?;
        if !end {
            self.caller.stop()?;
        }
        for w in task.take_warnings() {
            self.caller.warn(&w, None)?;
        }
        if self.metered {
            self.tell_metered(task, end)?;
        } else if !self.ended && task.measured() {
            let (done, total) = task.progress();
            self.ended = done >= total;
            self.caller.progress(done, total)?;
        }
        // A stop request a callback just made (a cancel flag set from `progress`) is
        // honoured before the next step: that step may be the commit point.
        if !end {
            self.caller.stop()?;
        }
        Ok(())
    }

    /// A folder run's warnings, each with the path it names, as they are said.
    fn tell_said(&mut self, task: &mut impl Task) -> Told<C> {
        for (w, at) in task.take_said() {
            self.caller.warn(&w, at.as_deref())?;
        }
        Ok(())
    }

    /// A folder run's progress, each value told once.
    fn tell_metered(&mut self, task: &impl Task, end: bool) -> Told<C> {
        let file = task.file_progress();
        if let Some((rel, done, total)) = file {
            let now = Some((rel.to_os_string(), done, total));
            if self.file_told != now {
                self.file_told = now;
                self.caller.file_progress(rel, done, total)?;
            }
        }
        let (done, total) = task.progress();
        let now = match (end, file) {
            (true, _) => Some((total, total)),
            (false, Some(_)) => Some((done, total)),
            (false, None) => None,
        };
        if let Some((done, total)) = now.filter(|&n| self.told != Some(n)) {
            self.told = Some((done, total));
            self.caller.progress(done, total)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
