//! Tests of the torch reader: generated files, hostile files, and files torch wrote.

mod corpus;
mod fixtures;
mod generated;
mod hostile;
mod shared;
mod writer;
