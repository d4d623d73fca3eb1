//! The `launcher` binary: everything is in the library (`lib.rs`, whose header says what the
//! launcher does and where each part lives).

fn main() -> std::process::ExitCode {
    launcher::main()
}
