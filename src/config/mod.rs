//! Configuration: the YAML model ([`model`]), the files a path names ([`files`]), their text
//! parsed into the model ([`parse`]) and compiled into the rule tree ([`compile`]), every
//! problem as a [`ConfigError`] ([`errors`]), hot reload ([`watch`]), `RateLimitConfig`
//! resources received over xDS into the same compiler ([`xds_resources`]), and config
//! durations ([`duration`]).

pub mod compile;
pub mod duration;
pub mod errors;
pub mod files;
pub mod model;
mod parse;
pub mod watch;
pub mod xds_resources;

pub use compile::{LoadOptions, compile_sources, compile_sources_with};
pub use errors::{ConfigError, ConfigErrors};
pub use files::{Loaded, load_path, load_path_with};
