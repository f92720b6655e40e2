//! What the test modules share beside `idemq_tests`, which cannot hold it: these
//! need idemq's `testing` feature, which only the test targets have (a
//! dev-dependency's feature; see [`faults`]).

pub(crate) mod cluster;
pub(crate) mod faults;
