//! Deterministic fault injection for tests, armed by `STCAST_FAILPOINT` (read in `env`).
//!
//! `STCAST_FAILPOINT=NAME=ACTION[,NAME=ACTION...]`. Points of one file's writing: `create`,
//! `tmpfile`, `prealloc`, `mid-tensor`, `fsync`, `publish`, `write-temp`; of a folder run:
//! `folder-checked` (every refusal done, nothing written), `folder-listed` (the survey of a
//! destination: its files listed, its manifests not yet read), `folder-manifest` (the
//! run's manifest written, no output yet),
//! `folder-sealed` (an output sealed and claimed in the manifest, not yet published),
//! `folder-published` (that output published, the manifest not yet recording it),
//! `folder-file` (after each converted file, recorded), `folder-publish` (before the
//! copies, configs and indexes), `folder-complete` (all written and re-checked, manifests
//! still there).
//! Actions:
//! - `eio`, `enospc`, `eopnotsupp`: fail the step with that error (`tmpfile=eopnotsupp`
//!   makes the file system look like one without `O_TMPFILE`, so the named-temp path runs);
//! - `sigint`, `sigterm`, `sighup`: raise that signal in this process, then fail the step as
//!   an interrupted call, which is how a real signal arriving at that moment is seen;
//! - `stop`: raise SIGSTOP, then go on once continued (SIGCONT). A test waits for the stop
//!   (`waitpid(WUNTRACED)`), acts (SIGKILL, modify the input, start a rival run), and
//!   resumes us: faults at an exact point without any sleeping.
//!
//! Unarmed, a point costs one load and a length test (about a nanosecond), and the hot
//! loop hits one at most once per conversion: compiled in, it costs nothing measurable.

use std::io;

/// Fail (or stop) here if the environment asks for it.
pub fn hit(name: &str) -> io::Result<()> {
    let points = crate::env::failpoints();
    if points.is_empty() {
        return Ok(());
    }
    let Some((_, action)) = points.iter().find(|(k, _)| k == name) else {
        return Ok(());
    };
    let errno = |e| Err(io::Error::from_raw_os_error(e));
    let signal = |sig| {
        // SAFETY: raising a signal in our own process; its handler decides what happens.
        unsafe { libc::raise(sig) };
        Err(io::Error::from_raw_os_error(libc::EINTR))
    };
    match action.as_str() {
        "eio" => errno(libc::EIO),
        "enospc" => errno(libc::ENOSPC),
        "eopnotsupp" => errno(libc::EOPNOTSUPP),
        "sigint" => signal(libc::SIGINT),
        "sigterm" => signal(libc::SIGTERM),
        "sighup" => signal(libc::SIGHUP),
        "stop" => {
            // SAFETY: as above; SIGSTOP suspends the whole process until a SIGCONT.
            unsafe { libc::raise(libc::SIGSTOP) };
            Ok(())
        }
        _ => Ok(()),
    }
}
