//! What a release build of the workspace compiles in, read from cargo's own
//! dependency tree (`cargo tree --offline`: no network, no build).

use std::process::Command;

/// `cargo tree` of the workspace, inverted on `idemq`, over the edge kinds `edges`.
fn idemq_tree(edges: &str) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let output = Command::new(cargo)
        .args(["tree", "--offline", "--manifest-path", manifest, "--workspace", "-e", edges, "-i", "idemq"])
        .output()
        .expect("run cargo tree");
    assert!(output.status.success(), "cargo tree failed: {}", String::from_utf8_lossy(&output.stderr));
    let tree = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(tree.contains("idemq feature \"default\""), "not the tree expected:\n{tree}");
    tree
}

/// `cargo build --release --workspace --bins` (what ships `payments`) compiles idemq
/// without its feature `testing`, which holds the test-only fault hooks
/// (`idemq::testing::fault`): no normal or build dependency of any workspace member
/// enables it (the scale benchmark's `test-cluster` has no hooks). The integration
/// tests still get it, through a dev-dependency, which resolver 2 does not unify into
/// non-test builds.
#[test]
fn release_builds_of_the_workspace_leave_the_fault_hooks_out() {
    let testing = "idemq feature \"testing\"";
    let shipped = idemq_tree("normal,build,features");
    assert!(
        !shipped.contains(testing),
        "a normal dependency enables the fault hooks (`testing`):\n{shipped}"
    );
    let tested = idemq_tree("features");
    assert!(tested.contains(testing), "the tests lost the fault hooks (`testing`):\n{tested}");
}
