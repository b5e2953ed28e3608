use std::ffi::OsStr;

use super::*;
use crate::vocab::WarningKind;

/// A caller that records what it is told, and stops when `stop_at` visits have passed.
#[derive(Default)]
struct Recorder {
    told: Vec<String>,
    visits: usize,
    stop_at: Option<usize>,
}

impl Caller for Recorder {
    type Failure = String;
    fn stop(&mut self) -> std::result::Result<(), String> {
        self.visits += 1;
        match self.stop_at {
            Some(n) if self.visits > n => Err("stopped".into()),
            _ => Ok(()),
        }
    }
    fn warn(&mut self, w: &Warning, at: Option<&OsStr>) -> std::result::Result<(), String> {
        self.told.push(format!("warn {} {:?}", w.text, at));
        Ok(())
    }
    fn progress(&mut self, done: u64, total: u64) -> std::result::Result<(), String> {
        self.told.push(format!("{done}/{total}"));
        Ok(())
    }
    fn file_progress(&mut self, rel: &OsStr, d: u64, t: u64) -> std::result::Result<(), String> {
        self.told.push(format!("{} {d}/{t}", rel.to_string_lossy()));
        Ok(())
    }
    fn away<T: Send>(&mut self, f: impl FnOnce() -> T + Send) -> std::result::Result<T, String> {
        Ok(f())
    }
    fn failure(&mut self, e: Error) -> String {
        format!("failed: {e:?}")
    }
    fn panicked(&mut self, message: String) -> String {
        message
    }
}

/// A task of `total` bytes done `step` at a time (one file, `a`, when `file`); it fails at
/// `fail_at` bytes, and says its failure was handled (`failed`).
struct Counting {
    done: u64,
    total: u64,
    file: bool,
    fail_at: Option<u64>,
    warned: bool,
}

impl Task for Counting {
    fn step(&mut self, budget: u64) -> Result<bool> {
        if self.fail_at.is_some_and(|at| self.done >= at) {
            return Err(Error::Cancelled);
        }
        self.done = (self.done + budget).min(self.total);
        Ok(self.done == self.total)
    }
    fn progress(&self) -> (u64, u64) {
        (self.done, self.total)
    }
    fn take_warnings(&mut self) -> Vec<Warning> {
        if std::mem::replace(&mut self.warned, true) {
            return Vec::new();
        }
        vec![Warning {
            kind: WarningKind::ALL[0],
            text: "w".into(),
        }]
    }
    fn file_progress(&self) -> Option<(&OsStr, u64, u64)> {
        self.file
            .then_some((OsStr::new("a"), self.done, self.total))
    }
    fn failed(&mut self, _: Error) -> Error {
        Error::Cancelled
    }
}

fn counting(total: u64) -> Counting {
    Counting {
        done: 0,
        total,
        file: false,
        fail_at: None,
        warned: false,
    }
}

#[test]
fn a_one_file_task_tells_each_step_and_its_end_once() {
    let mut d = Driver::new(Recorder::default());
    d.drive(&mut counting(10), 4).unwrap();
    assert_eq!(
        d.caller.told,
        ["warn w None", "0/10", "4/10", "8/10", "10/10"]
    );
    // A visit after the end (a seal, a publish) tells no more.
    let mut again = counting(10);
    again.done = 10;
    d.visit(&mut again, false).unwrap();
    assert_eq!(d.caller.told.len(), 6); // (only its warning)
}

#[test]
fn a_metered_run_tells_progress_once_a_file_has_begun_and_its_end_once() {
    let mut d = Driver::new(Recorder::default());
    d.metered = true;
    let mut none = counting(0);
    d.drive(&mut none, 4).unwrap();
    assert_eq!(d.caller.told, ["warn w None", "0/0"]);
    let mut d = Driver::new(Recorder::default());
    d.metered = true;
    let mut task = counting(8);
    task.file = true;
    d.drive(&mut task, 4).unwrap();
    let want = [
        "warn w None",
        "a 0/8",
        "0/8",
        "a 4/8",
        "4/8",
        "a 8/8",
        "8/8",
    ];
    assert_eq!(d.caller.told, want);
}

#[test]
fn a_stop_request_wins_over_the_failure_it_caused_but_not_after_the_commit_point() {
    // (Each visit asks twice: before and after the callbacks.)
    let mut d = Driver::new(Recorder {
        stop_at: Some(4),
        ..Recorder::default()
    });
    let mut task = counting(10);
    task.fail_at = Some(4);
    assert_eq!(d.drive(&mut task, 4), Err("stopped".to_string()));
    assert_eq!(d.caller.visits, 5); // (the fifth: after the failing step)
                                    // No stop request: the failure as the task handled it.
    let mut d = Driver::new(Recorder::default());
    let mut task = counting(10);
    task.fail_at = Some(4);
    assert_eq!(d.drive(&mut task, 4), Err("failed: Cancelled".to_string()));
    // After the commit point, the failure is told whatever came meanwhile.
    let mut d = Driver::new(Recorder {
        stop_at: Some(0),
        ..Recorder::default()
    });
    let late = || -> Result<()> {
        Err(Error::AfterCommit {
            published: "out".into(),
            source: Box::new(Error::Cancelled),
            folder: true,
        })
    };
    assert!(d.run(late).unwrap_err().starts_with("failed: AfterCommit"));
    // And once the last step is done, a stop request no longer stops the task.
    let mut d = Driver::new(Recorder {
        stop_at: Some(2),
        ..Recorder::default()
    });
    d.drive(&mut counting(4), 4).unwrap();
}

/// A task that is done (all its bytes) a step before its commit point (`published`).
struct Committing {
    done: bool,
    published: bool,
}

impl Task for Committing {
    fn step(&mut self, _: u64) -> Result<bool> {
        if self.done {
            self.published = true;
        }
        self.done = true;
        Ok(self.published)
    }
    fn progress(&self) -> (u64, u64) {
        (u64::from(self.done), 1)
    }
    fn take_warnings(&mut self) -> Vec<Warning> {
        Vec::new()
    }
}

/// Stops once told of the end: as a cancel flag set from the `progress` callback.
struct CancelAtEnd(bool);

impl Caller for CancelAtEnd {
    type Failure = String;
    fn stop(&mut self) -> std::result::Result<(), String> {
        if self.0 {
            return Err("cancelled".into());
        }
        Ok(())
    }
    fn warn(&mut self, _: &Warning, _: Option<&OsStr>) -> std::result::Result<(), String> {
        Ok(())
    }
    fn progress(&mut self, done: u64, total: u64) -> std::result::Result<(), String> {
        self.0 = done == total;
        Ok(())
    }
    fn file_progress(&mut self, _: &OsStr, _: u64, _: u64) -> std::result::Result<(), String> {
        Ok(())
    }
    fn away<T: Send>(&mut self, f: impl FnOnce() -> T + Send) -> std::result::Result<T, String> {
        Ok(f())
    }
    fn failure(&mut self, e: Error) -> String {
        format!("{e:?}")
    }
    fn panicked(&mut self, message: String) -> String {
        message
    }
}

#[test]
fn a_stop_request_a_callback_makes_is_honoured_before_the_next_step() {
    // The end told before the commit point: a cancel set then leaves it unpublished.
    let mut d = Driver::new(CancelAtEnd(false));
    let mut task = Committing {
        done: false,
        published: false,
    };
    assert_eq!(d.drive(&mut task, 1), Err("cancelled".to_string()));
    assert!(task.done && !task.published);
}
