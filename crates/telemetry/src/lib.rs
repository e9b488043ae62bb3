//! Live figures about the machine for the app and `/v1/status`: memory (system, this
//! process; MLX's allocator added by the caller), fans and temperatures, thermal state. A figure the machine does
//! not expose is `None` ("not available"), never made up. [`Sampler`] reads them on a thread
//! of its own once a second, so readers never wait on the system.

pub mod machine;
pub mod memory;
pub mod sampler;
pub mod smc;
pub mod thermal;

pub use memory::Memory;
pub use sampler::{Sampler, Snapshot};
pub use thermal::Thermal;
