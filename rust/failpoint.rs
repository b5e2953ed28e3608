//! Deterministic fault injection for tests, switched on by an environment variable.
//!
//! `STCAST_FAILPOINT=NAME=ACTION[,NAME=ACTION...]`, read once. Points: `create`,
//! `prealloc`, `mid-tensor`, `fsync`, `publish`. Actions:
//! - `eio`, `enospc`: fail the step with that error;
//! - `sigint`: raise SIGINT in this process, then fail the step as an interrupted call, which
//!   is how a real Ctrl-C arriving at that moment is seen;
//! - `stop`: raise SIGSTOP, then go on once continued (SIGCONT). A test waits for the stop
//!   (`waitpid(WUNTRACED)`), acts (SIGKILL, modify the input, start a rival run), and resumes
//!   us: faults at an exact point without any sleeping.
//!
//! Unset, a point costs one load.

use std::io;
use std::sync::OnceLock;

fn points() -> &'static [(String, String)] {
    static POINTS: OnceLock<Vec<(String, String)>> = OnceLock::new();
    POINTS.get_or_init(|| {
        std::env::var("STCAST_FAILPOINT")
            .unwrap_or_default()
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect()
    })
}

/// Fail (or stop) here if the environment asks for it.
pub fn hit(name: &str) -> io::Result<()> {
    let Some((_, action)) = points().iter().find(|(k, _)| k == name) else {
        return Ok(());
    };
    match action.as_str() {
        "eio" => Err(io::Error::from_raw_os_error(libc::EIO)),
        "enospc" => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
        "sigint" => {
            // SAFETY: raising a signal in our own process; its handler decides what happens.
            unsafe { libc::raise(libc::SIGINT) };
            Err(io::Error::from_raw_os_error(libc::EINTR))
        }
        "stop" => {
            // SAFETY: as above; SIGSTOP suspends the whole process until a SIGCONT.
            unsafe { libc::raise(libc::SIGSTOP) };
            Ok(())
        }
        _ => Ok(()),
    }
}
