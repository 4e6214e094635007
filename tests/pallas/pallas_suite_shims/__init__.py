"""Stand-ins for the test utilities that JAX's Pallas test files import and
the installed JAX may lack (`jax._src.pallas.pallas_test_util`,
`jax._src.hypothesis_test_util`), written for dsl: the harness
(tests/pallas/pallas_suite.py) points those imports here."""
