//! The `slidegate` binary: the command line in [`cli`], everything else in the library.
#![forbid(unsafe_code)]

mod cli;

/// mimalloc instead of the C library's allocator: a decision allocates and frees many small
/// buffers on every thread, and glibc's malloc spent about a fifth of slidegate's time on them
/// under load (`docs/performance.md`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
