//! A stand-in for the daemon binary, so integration tests can run
//! [`tiller_tools::supervise`] in a process of its own, exactly as the
//! daemon does: `tiller-supervise-test __supervise -- sh -c COMMAND`.
//! The daemon calls `supervise` from its own `main`; nothing installs
//! this binary.

use std::ffi::OsString;

fn main() {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    match args.split_first() {
        Some((first, rest)) if first == tiller_tools::SUPERVISE_ARG => {
            std::process::exit(tiller_tools::supervise(rest));
        }
        _ => {
            eprintln!(
                "usage: tiller-supervise-test {} -- PROGRAM [ARGUMENT...]",
                tiller_tools::SUPERVISE_ARG
            );
            std::process::exit(2);
        }
    }
}
