"""Tests the default suite leaves to `-m slow` (besides those marked slow
where they are defined), so that `make test` stays near six minutes on two
cores. Each is the costliest variant of a check the default suite still
makes in a cheaper form, named beside it. `tests/conftest.py` marks them.

    nodeid (under tests/pallas/) -> what in the default suite covers it
"""

SLOW: dict[str, str] = {
    "test_kernels_attention.py::test_gradients_match_reference":
        "test_bf16_gradients_gqa_causal_partial_blocks",
    "test_kernels_attention.py::test_tpu_layout_gqa_segments_and_backward":
        "test_pallas_ops.py's tpu.flash_attention cases",
    "test_kernels_attention.py::test_other_cpu_backends_partial_blocks_and_"
    "backward[triton_interpret]": "its mosaic_interpret variant",
    "test_kernels_attention.py::test_vmap_of_forward_and_gradient":
        "test_transforms.py's vmap tests",
    "test_kernels_attention.py::test_hand_written_backward_matches_automatic":
        "test_kernels_matmul.py's same check",
    "test_kernels_decode.py::test_paged_matches_reference":
        "test_paged_ignores_table_entries_past_the_length",
    "test_grad_backends.py::test_cumulative_ops_and_their_jvp[cummax-"
    "interpret]": "its other backends and the grad corpus's cumulative case",
    "test_grad_backends.py::test_matmul_accumulator_grads[interpret]":
        "its triton_interpret and mosaic_interpret variants",
    "test_grad_dma.py::test_grads[interpret-emit_pipeline_matmul]":
        "its triton_interpret variant",
    "test_grad_dma.py::test_grads[triton_interpret-emit_pipeline_elementwise]":
        "its interpret variant",
    "test_grad_dma.py::test_spin_finds_no_race_or_deadlock_in_derived_"
    "kernels[emit_pipeline_elementwise]": "its double_buffered variant",
    "test_kernels_norms.py::test_layer_norm_gradients":
        "test_rms_norm_gradients and the grad corpus's layer_norm case",
    "test_feature_properties.py::test_blocked_matmul[triton_interpret]":
        "its interpret variant",
    "test_feature_properties.py::test_row_reductions[interpret]":
        "its triton_interpret variant",
    "test_feature_properties.py::test_blocked_elementwise_2d[triton_"
    "interpret]": "its interpret variant",
    "test_kernels_matmul.py::test_gradients_match_reference":
        "test_bf16_gradients_and_leading_dims",
    "test_kernels_matmul.py::test_hand_written_backward_matches_automatic":
        "the grad corpus's matmul case",
    "test_autotune.py::test_hit_across_processes":
        "test_a_script_and_the_same_module_imported_share_cache_entries",
    "test_reliability_triton.py::test_nan_combine_helpers_match_their_numpy_"
    "fast_path": "the Triton reduction tests of test_triton_ops.py",
    "test_tpu_pipeline_edges.py::test_matmul_with_accumulator[interpret-"
    "bf16_edges_everywhere]": "its f32_k_edge_only variant",
    "test_tpu_pipeline_edges.py::test_matmul_with_accumulator[interpret-"
    "f32_edges_everywhere]": "its f32_k_edge_only variant",
    "test_triton_kernels.py::test_kernels_compile_ahead_of_time[test_kernels_"
    "decode-sm_90]": "the performance contracts' decode case",
    "test_tpu_prng.py::test_gradient_of_a_kernel_seeded_from_scalar_"
    "prefetch[12345-interpret]": "its seed-3 variants",
}
