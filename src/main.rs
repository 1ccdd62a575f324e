//! The `slidegate` binary: the command line in [`cli`], everything else in the library.
#![forbid(unsafe_code)]

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
