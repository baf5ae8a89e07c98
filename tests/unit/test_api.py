"""The RLHFJob API models: the example is valid; each kind of bad input is rejected naming the field."""

from pathlib import Path

import pytest
import yaml

from pat_operator.api import JobSpecError, load_job, parse_job

EXAMPLE = Path(__file__).parents[2] / "examples" / "local.yaml"


def example(placement: str = "separate") -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["placement"] = placement
    return doc


def test_example_is_valid_and_camel_case_round_trips():
    job = load_job(EXAMPLE)
    assert job.spec.generator.ranks_per_pod == 2 and job.spec.generator.adaptive_tp.controller == "pod"
    assert job.spec.generator.ranks == 2 and job.spec.generator.tp_sizes == [1, 2]  # tpSizes' default: all
    again = parse_job(job.model_dump(by_alias=True))
    assert again == job
    assert "adaptiveTP" in job.spec.generator.model_dump(by_alias=True)


@pytest.mark.parametrize("edit, field", [
    (lambda s: s["algorithm"].update(learningRate=-1), "spec.algorithm.learningRate"),
    (lambda s: s["algorithm"].update(samplesPerPrompt=1), "spec.algorithm.samplesPerPrompt"),
    (lambda s: s["algorithm"].update(lossAggregation="mean"), "spec.algorithm.lossAggregation"),
    (lambda s: s["algorithm"].update(clipRatoi=0.2), "spec.algorithm.clipRatoi"),  # a typo is not ignored
    (lambda s: s["generator"].update(ranksPerPod=3), "generator.ranksPerPod=3: use a power of two"),
    (lambda s: s["generator"].update(gpusPerPod=3, ranksPerPod=None), "generator.gpusPerPod=3: use a power of two"),
    (lambda s: s["generator"].update(gpusPerPod=2, ranksPerPod=4), "generator.ranksPerPod=4 must equal gpusPerPod=2"),
    (lambda s: s["generator"].pop("ranksPerPod"), "gpusPerPod=0 needs generator.ranksPerPod"),
    (lambda s: s["generator"]["adaptiveTP"].update(tpSizes=[1, 4]), "4 is not a power of two dividing the 2 ranks"),
    (lambda s: s["generator"]["adaptiveTP"].update(tpSizes=[2]), "tpSizes must include 1"),
    (lambda s: s["generator"]["adaptiveTP"].update(controller="both"), "spec.generator.adaptiveTP.controller"),
    (lambda s: s["generator"]["adaptiveTP"].update(minGain=-0.1), "spec.generator.adaptiveTP.minGain"),
    (lambda s: s["generator"]["adaptiveTP"].update(margin=0.1), "adaptiveTP.margin: unknown field; use one of"),
    (lambda s: s.update(adaptiveTP={}), "spec.adaptiveTP: unknown field"),  # it moved under generator
    (lambda s: s["model"].update(path="/models/x"), "exactly one of model.path"),
    (lambda s: s["dataset"].pop("synthetic"), "exactly one of dataset.path"),
    (lambda s: s["reward"].update(function="nomodule"), "module:function"),
    (lambda s: s["generator"].update(maxSeq=40), "raise maxSeq"),
    (lambda s: s["reward"].update(overlongBuffer=192), "reward.overlongBuffer=192"),
    (lambda s: s["algorithm"].update(promptsPerIteration=1, samplesPerPrompt=2, miniBatches=2)
     or s["trainer"].update(replicas=2), "each of the 2 trainer ranks (trainer.replicas x ranks per pod)"),
    (lambda s: s["trainer"].update(gpusPerPod=2, ranksPerPod=1), "trainer.ranksPerPod=1 must equal gpusPerPod=2"),
    (lambda s: s["algorithm"].update(maxTokensPerMicroBatch=100), "algorithm.maxTokensPerMicroBatch=100 is below"),
    (lambda s: s["generator"].update(tensorParallelSize=4, adaptiveTP={"enabled": False}),
     "generator.tensorParallelSize=4 is not a power of two dividing the 2 ranks per pod; use one of [1, 2]"),
    (lambda s: s["generator"].update(tensorParallelSize=3, ranksPerPod=4, adaptiveTP={"enabled": False}),
     "generator.tensorParallelSize=3 is not a power of two dividing the 4 ranks per pod"),
    (lambda s: s["generator"].update(tensorParallelSize=0), "spec.generator.tensorParallelSize"),
    (lambda s: s["generator"].update(tensorParallelSize=2),  # adaptiveTP.enabled: true (the example's)
     "generator.tensorParallelSize=2 fixes the layout, and adaptive TP regroups it"),
    (lambda s: s["generator"].update(tensorParallelSize=2, adaptiveTP={}),  # adaptive by default with engine pat
     "set generator.adaptiveTP.enabled: false for a fixed layout"),
    (lambda s: s["generator"].update(tensorParallelSize=2, engine="vllm", adaptiveTP={}),
     "generator.tensorParallelSize=2 is engine pat's fixed layout; engine vllm: set generator.vllm.tensorParallelSize"),
    (lambda s: s["generator"].update(compileStep=True, engine="vllm", adaptiveTP={"enabled": False}),
     "generator.compileStep is engine pat's; vLLM compiles its own step"),
])
def test_bad_fields_are_named(edit, field):
    doc = example()
    edit(doc["spec"])
    with pytest.raises(JobSpecError) as e:
        parse_job(doc)
    assert field in str(e.value)


def test_ranks_default_to_one_per_gpu():
    doc = example()
    doc["spec"]["generator"].update(gpusPerPod=4, ranksPerPod=None)
    generator = parse_job(doc).spec.generator
    assert generator.ranks == 4 and generator.tp_sizes == [1, 2, 4]


def test_a_fixed_layout_needs_adaptive_tp_off_and_starts_every_batch_in_its_groups():
    doc = example()
    assert parse_job(doc).spec.generator.start_layout == (1, 1)  # the default: TP=1 replicas
    doc["spec"]["generator"].update(gpusPerPod=8, ranksPerPod=None, tensorParallelSize=4,
                                    adaptiveTP={"enabled": False})
    generator = parse_job(doc).spec.generator
    assert generator.tensor_parallel_size == 4 and generator.start_layout == (4, 4) and not generator.adaptive


def test_a_typo_gets_the_closest_field():
    doc = example()
    doc["spec"]["algorithm"]["clipRatoi"] = 0.3
    doc["spec"]["generator"]["env"] = [{"nmae": "A", "value": "1"}]
    with pytest.raises(JobSpecError) as e:
        parse_job(doc)
    assert "spec.algorithm.clipRatoi: unknown field; did you mean clipRatio?" in str(e.value)
    assert "spec.generator.env.0.nmae: unknown field; did you mean name?" in str(e.value)


def test_bad_name_and_missing_file(tmp_path):
    doc = example()
    doc["metadata"]["name"] = "Not_A_DNS_Name"
    with pytest.raises(JobSpecError, match="metadata.name"):
        parse_job(doc)
    with pytest.raises(JobSpecError, match="cannot read"):
        load_job(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("spec: [")
    with pytest.raises(JobSpecError, match="not valid YAML"):
        load_job(tmp_path / "broken.yaml")


def test_colocated_is_the_default_and_the_trainer_takes_the_generator_pods_shape():
    doc = example(placement="colocated")
    del doc["spec"]["placement"], doc["spec"]["trainer"]
    spec = parse_job(doc).spec
    assert spec.placement == "colocated"
    g = spec.generator
    assert (spec.trainer.replicas, spec.trainer.ranks, spec.trainer.world_size) == (g.replicas, g.ranks, 2)
    separate = example()
    assert parse_job(separate).spec.trainer.world_size == 1  # the example's one trainer rank, on its own pod


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["trainer"].update(replicas=2), "trainer.replicas=2 differs from generator.replicas=1"),
    (lambda s: s["trainer"].update(ranksPerPod=1), "trainer.ranksPerPod=1 differs"),
    (lambda s: (s["trainer"].update(gpusPerPod=8, nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
                s["generator"].update(gpusPerPod=8, ranksPerPod=None,
                                      nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"})),
     "cannot select different GPU types"),
    (lambda s: s["generator"].update(engine="vllm", adaptiveTP={"enabled": False}),
     "spec.placement: colocated runs vLLM with its sleep mode, which needs CUDA"),
    (lambda s: (s["trainer"].update(gpusPerPod=2), s["generator"].update(engine="vllm", adaptiveTP={"enabled": False},
                                                                         gpusPerPod=2, ranksPerPod=None)),
     "which this version does not have yet"),
])
def test_colocated_refuses_what_cannot_share_the_devices(edit, message):
    doc = example(placement="colocated")
    edit(doc["spec"])
    with pytest.raises(JobSpecError, match="spec.placement") as e:
        parse_job(doc)
    assert message in str(e.value)
    doc["spec"]["placement"] = "separate"  # negative control: separate pods may differ
    if "vLLM" not in message and "vllm" not in message:
        parse_job(doc)
