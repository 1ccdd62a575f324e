#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    slidegate::cli::main()
}
