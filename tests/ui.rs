//! Lifecycle misuse that must not compile: one real misuse per case in `ui-tests/`, each with
//! the compiler's reviewed diagnostic next to it.

#[test]
fn lifecycle_misuse_does_not_compile() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("ui-tests/**/*.rs");
}
