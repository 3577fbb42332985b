"""FP16 and PowerSGD hooks converge like plain all-reduce, and the bytes they send are counted exactly."""

from ddp_group import Group, assert_ok, run_group, write_job

# MLP 64-64-10: W1 64x64, b1 64, W2 10x64, b2 10, one bucket of 4810 floats.
BUCKET_NUMEL = 64 * 64 + 64 + 10 * 64 + 10
# PowerSGD at rank 2 sends P and Q of each matrix, the biases as they are.
POWERSGD_NUMEL = (64 + 64) * 2 + 64 + (10 + 64) * 2 + 10


def test_fp16_hook_sends_half_the_bytes_and_converges(baseline: Group, tmp_path):
    group = run_group(write_job(tmp_path, ddp={"commHook": "FP16"}), tmp_path / "run")
    assert_ok(group)
    for rank in (0, 1):
        hook = group.result(rank)["comm_hook"]
        assert hook["name"] == "FP16" and hook["compressed_steps"] == 230
        assert hook["raw_bytes"] == 230 * BUCKET_NUMEL * 4
        assert hook["sent_bytes"] * 2 == hook["raw_bytes"]
    assert abs(group.result(0)["eval_accuracy"] - baseline.result(0)["eval_accuracy"]) <= 0.02


def test_powersgd_hook_converges_and_its_bytes_shrink_by_its_own_compression_rate(baseline: Group, tmp_path):
    group = run_group(write_job(tmp_path, ddp={"commHook": "PowerSGD", "powerSGDRank": 2}), tmp_path / "run")
    assert_ok(group)
    accuracy, reference = group.result(0)["eval_accuracy"], baseline.result(0)["eval_accuracy"]
    for rank in (0, 1):
        result = group.result(rank)
        hook = result["comm_hook"]
        # 10% of the 230 steps run plain all-reduce first (PowerSGD's warm-up).
        assert hook["powersgd_start_iter"] == 23 and hook["compressed_steps"] == 230 - 23
        # The hook's own statistics, counted in elements by PowerSGDState ...
        assert hook["powersgd_numel_before"] == hook["compressed_steps"] * BUCKET_NUMEL
        assert hook["powersgd_numel_after"] == hook["compressed_steps"] * POWERSGD_NUMEL
        # ... and the bytes the CountingGroup saw go into all-reduce in those steps.
        counted = hook["compressed_raw_bytes"] / hook["compressed_sent_bytes"]
        assert abs(counted - hook["powersgd_compress_rate"]) <= 1e-9 * counted
        # Over the whole run, warm-up included, the bytes still shrink about 5x.
        assert result["raw_gradient_bytes"] == 230 * BUCKET_NUMEL * 4
        assert result["compression_ratio"] >= 4
    print(f"PowerSGD rank 2: accuracy {accuracy:.4f} vs {reference:.4f}; counted rate {counted:.4f} = "
          f"hook's {hook['powersgd_compress_rate']:.4f}; whole run {result['compression_ratio']:.3f}x")
    assert abs(accuracy - reference) <= 0.02
