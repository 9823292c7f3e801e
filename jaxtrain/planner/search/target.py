"""What a plan is for: the hardware (a shipped description, or the devices at hand), the devices that compile
the step, the node count, the config as it would run there, and the meshes to plan (given or enumerated)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxtrain.cluster import process
from jaxtrain.config import Config, hardware, validate
from jaxtrain.config.hardware import Hardware
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import MeshShape


@dataclass
class Target:
    cfg: Config  # no "auto" left: resolved for the target hardware
    hw: Hardware
    devices: list  # the devices that compile the step (emulated CPU devices stand in for the target's)
    nodes: int
    shapes: list[MeshShape]
    notes: list[str] = dataclasses.field(default_factory=list)  # where the plan differs from the run it plans
    attention: str = ""  # the kernel the run uses ("" : cfg's); cuDNN where cfg compiles a stand-in for it

    @property
    def n_devices(self) -> int:
        return len(self.devices)


def mesh_given(overrides: list[str]) -> bool:
    """Whether the command line sets a mesh size (then only that mesh is planned)."""
    return any(o.partition("=")[0].strip().startswith(("mesh.ici.", "mesh.dcn.")) for o in overrides)


def as_on_gpu(cfg: Config) -> Config:
    """``cfg`` as it would run on GPUs, compilable by the CPU that makes the plan: the one place the planner's
    choices differ from the training run's.

    "auto" means what it means on a GPU (``layout.resolve_auto(cfg, "gpu")``). STAND-IN: where that choice (or the
    config's) is cuDNN's fused attention, which XLA:CPU cannot compile, the plan compiles jaxtrain's Pallas flash
    kernel instead (interpreted on CPU): like cuDNN's, its memory grows with the sequence, not with its square as
    the XLA reference's scores do, and the collectives do not depend on the attention kernel. Where the flash
    kernel does not take the config (e.g. a head dim outside config.FLASH_HEAD_DIMS) the XLA reference stands in,
    and the plan's temporaries are then an upper bound.
    """
    from jaxtrain.parallel.layout import resolve_auto  # imports JAX: only once the plan's XLA flags are set

    cfg = resolve_auto(cfg, "gpu")
    if cfg.model.attention != "cudnn":
        return cfg
    for stand_in in ("pallas", "xla"):
        candidate = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=stand_in))
        try:
            validate(candidate)
        except ConfigError:
            continue
        return candidate
    return cfg


def resolve(cfg: Config, overrides: list[str], *, hardware_name: str | None = None, nodes: int | None = None,
            efficiency: float | None = None, mem_fraction: float | None = None,
            device_pool: int | None = None) -> Target:
    """The target of a plan, with JAX's CPU devices configured for it. Every check on the user's input runs
    before JAX starts, so that a mistake answers at once. ``device_pool`` (with ``hardware_name``): how many CPU
    devices to create when plans for several node counts share one process (JAX sets the count once); the plan
    uses the first ``nodes`` x devices per node of them."""
    nodes = 1 if nodes is None else nodes
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes} must be >= 1")
    for name, value in (("efficiency", efficiency), ("mem-fraction", mem_fraction)):
        if value is not None and not 0 < value <= 1:
            raise ConfigError(f"--{name}={value} must be in (0, 1]")
    from jaxtrain.planner.search.meshes import given_shape, pipeline_note, search_shapes

    notes: list[str] = []

    def shapes_for(c: Config, n: int, k: int) -> list[MeshShape]:
        if mesh_given(overrides) and not c.mesh.auto:  # mesh.auto searches, keeping the sizes given (auto_keep)
            return [given_shape(c, n, k)]
        shapes, rejected = search_shapes(c, n, k)
        # mesh.auto searches the microbatch counts pipelines need: the note's advice is for a plan of the config's
        note = None if c.mesh.auto else pipeline_note(c, rejected, shapes)
        if note:
            notes.append(note)
        return shapes

    if hardware_name:
        hw = hardware.load_hardware(hardware_name)
        n_devices = hw.devices_per_node * nodes
        if cfg.runtime.cpu_devices not in (None, n_devices):
            raise ConfigError(f"runtime.cpu_devices={cfg.runtime.cpu_devices} contradicts --hardware {hardware_name} "
                              f"--nodes {nodes} ({n_devices} devices); drop it")
        hw = dataclasses.replace(hw, mem_fraction=mem_fraction or hardware.gpu_mem_fraction())
        notes += fp8_notes(cfg, hw)
        from jaxtrain.parallel.layout import resolve_auto  # imports JAX

        on_gpu, cfg = resolve_auto(cfg, "gpu"), as_on_gpu(cfg)
        if cfg.model.attention != on_gpu.model.attention:
            notes.append(f"attention {on_gpu.model.attention} (the choice on GPUs) is planned with "
                         f"{cfg.model.attention}: XLA:CPU cannot compile cuDNN; the collectives are the same, and "
                         "the flash kernel's memory, like cuDNN's, grows linearly with the sequence")
        shapes = shapes_for(cfg, n_devices, nodes)
        attention = on_gpu.model.attention
        devices = _compile_only_devices(n_devices, device_pool)
    else:
        import jax

        from jaxtrain.parallel.dims import cpu_devices_per_process
        from jaxtrain.planner.cost.measure import hardware_at_hand

        process.skip_aborting_passes()
        jax.config.update("jax_num_cpu_devices", cpu_devices_per_process(cfg))
        devices = jax.devices()
        n_devices = len(devices)
        if nodes == 1 and jax.process_count() > 1:
            nodes = jax.process_count()
        from jaxtrain.parallel.layout import resolve_auto

        cfg = resolve_auto(cfg, devices[0].platform)
        shapes = shapes_for(cfg, n_devices, nodes)
        hw = hardware_at_hand(devices, mem_fraction)
        attention = cfg.model.attention
    if efficiency:
        hw = dataclasses.replace(hw, compute_efficiency=efficiency)
    return Target(cfg, hw, devices, nodes, shapes, notes + measured_notes(cfg, hw, attention, efficiency), attention)


def _compile_only_devices(n_devices: int, device_pool: int | None) -> list:
    """The first ``n_devices`` of ``max(n_devices, device_pool)`` CPU devices to compile a GPU cluster's step on."""
    # Nothing compiled here ever runs, so skip LLVM's optimisations of the CPU code: about a third of the compile
    # time, and the HLO (collectives) and buffer assignment (memory) do not depend on it. Constant folding is
    # skipped too: on the 7B config it spent ~10 s per compile folding a scatter and printed XLA's "Constant
    # folding an instruction is taking > 1s" alarm (4 lines per compile); without it the collectives were
    # identical and the memory 130 kB (3e-6) lower. Not for the devices at hand: their rates are measured by
    # running code. Set before JAX creates its CPU client.
    process.skip_aborting_passes()
    process.add_xla_flags("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                          "--xla_disable_hlo_passes=constant_folding")
    import jax

    if not getattr(jax.config, "jax_platforms", None):
        # The plan compiles on CPU devices only: a CUDA plugin installed on a machine without a GPU (for the
        # XLA:GPU compiles, planner/xla_gpu/deviceless.py) would otherwise fail its start-up checks loudly here.
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(n_devices, device_pool or 0))
    return jax.devices("cpu")[:n_devices]


def measured_notes(cfg: Config, hw: Hardware, attention: str, efficiency: float | None) -> list[str]:
    """Which of the step's rates are measured (``jaxtrain/configs/hardware/measured/``) and which stand in."""
    from jaxtrain.planner.cost.measured import for_hardware, measured_rates

    rates = measured_rates(cfg, hw, attention)
    if rates is None:
        return []
    listed = "; ".join(f"{name.replace('_', ' ')} {rate / 1e12:,.0f} TFLOP/s ({source})"
                       for name, (rate, source) in rates.items())
    measured = for_hardware(hw)
    assert measured is not None
    note = f"compute priced at {hw.name}'s measured rates ({measured.provenance}): {listed}"
    if efficiency:
        note += f"; --efficiency {efficiency:g} applies to the datasheet figures only"
    return [note]


def fp8_notes(cfg: Config, hw: Hardware) -> list[str]:
    """The planner's word on model.fp8 for ``hw``: ConfigError where it has no FP8 tensor cores (never a silent
    16-bit plan), else a note saying which FLOPs the estimate puts at the FP8 rate."""
    if cfg.model.fp8 == "none":
        return []
    if hw.fp8_peak_flops <= 0:
        raise ConfigError(f"model.fp8={cfg.model.fp8} needs FP8 tensor cores, which {hw.name} ({hw.device}) lacks "
                          "(no fp8_peak_flops in its hardware file); set model.fp8=none or plan for h100-8x, "
                          "h200-8x or b200-8x")
    from jaxtrain.planner.cost.model import fp8_share

    return [f"model.fp8={cfg.model.fp8}: the attention and MLP projections ({fp8_share(cfg):.0%} of the model FLOPs) "
            f"at the FP8 peak {hw.fp8_peak_flops / 1e12:,.0f} TFLOP/s, the rest at {hw.peak_flops / 1e12:,.0f}"]
