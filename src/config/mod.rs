//! Configuration: the YAML model ([`model`]), loading and validation into compiled rules
//! ([`load`]), hot reload ([`watch`]), the xDS source ([`xds`]), and config durations ([`duration`]).

pub mod duration;
pub mod load;
pub mod model;
pub mod watch;
pub mod xds;

pub use load::{
    ConfigError, ConfigErrors, LoadOptions, Loaded, compile_sources, compile_sources_with,
    load_path, load_path_with,
};
