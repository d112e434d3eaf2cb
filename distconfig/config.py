"""A DistConfig: one named way to parallelize the model (dp x cp x tp x pp, optional sp) on some devices.

Its mesh has axes ("pp", "dp", "cp", "tp") with tp innermost, so tensor-parallel peers are consecutive
ranks and share a node (as in Megatron-LM), context-parallel peers come next (their key/value
exchange is the next heaviest traffic), and pipeline stages are the outermost blocks.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .mesh import Mesh

__all__ = ["DistConfig", "parse_configs", "standard_configs"]

AXIS_NAMES = ("pp", "dp", "cp", "tp")
_COMPACT = re.compile(r"(?:(fs)?dp(\d+))?(?:tp(\d+))?(?:cp(\d+))?(?:pp(\d+))?(sp)?(?:-(full|sel))?")
RECOMPUTE = ("none", "selective", "full")  # DistConfig.recompute
_RECOMPUTE_SUFFIX = {"full": "full", "sel": "selective"}  # compact names: "dp4-full", "tp4sp-sel"
GRAMMAR = ("write a config as its compact name, e.g. 'dp4', 'dp2tp2', 'tp4sp', 'cp4', 'tp2cp2', 'tp2pp2', 'fsdp4', "
           "'fsdp2tp2' (degrees of 1 may be left out; 'fsdp' for dp shards the parameters; '-full' or '-sel' last "
           "recomputes activations: 'tp4sp-sel'), or as key=value pairs, e.g. 'dp=2,tp=2,sp' (keys name, dp, tp, cp, "
           "pp, sp, fsdp, recompute, devices; 'dp=4,fsdp,recompute=full'); separate several "
           "configs with ';' ('dp=4;tp=4,sp'), or with ',' between compact names ('dp4,dp2tp2,tp4sp')")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class DistConfig:
    """`devices` (optional) are the ranks the config runs on, in mesh order; default 0..world_size-1.

    `cp`: context parallelism. The sequence dim of every activation is sharded over the cp axis,
    weights are replicated over it like over dp (their gradients are reduced over dp x cp), and
    attention gathers the keys and values of the other cp ranks.

    `fsdp`: the data-parallel ranks shard the parameters, their gradients and optimizer state (ZeRO-3,
    torch's FSDP2): each block's parameters are all-gathered before its forward and again before its
    backward, its gradients reduce-scattered (`hotswitch.compiler.fsdp`). Composes with tp, sp, cp.

    `recompute`: activation recomputation. "full" keeps each block's inputs and recomputes the rest of
    its forward in the backward; "selective" keeps the matmul and attention outputs and recomputes
    what lies between them (norms, activations, rotary embeddings: Megatron's selective recompute
    in spirit); "none" keeps every activation the backward reads (`hotswitch.compiler.recompute`).
    """

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    devices: tuple[int, ...] | None = None
    cp: int = 1
    fsdp: bool = False
    recompute: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"DistConfig name {self.name!r} must be a non-empty identifier (letters, digits, '_', "
                "'-', '.'); pick a name like 'dp8' or 'long_seq'"
            )
        for axis in ("dp", "tp", "pp", "cp"):
            degree = getattr(self, axis)
            if not isinstance(degree, numbers.Integral) or isinstance(degree, bool) or degree < 1:
                raise ValueError(
                    f"DistConfig {self.name!r}: {axis} must be a positive int, got {degree!r}; "
                    f"use {axis}=1 for no {axis} parallelism"
                )
            object.__setattr__(self, axis, int(degree))
        if not isinstance(self.sp, bool):
            raise ValueError(f"DistConfig {self.name!r}: sp must be True or False, got {self.sp!r}")
        if self.sp and self.tp == 1:
            raise ValueError(
                f"DistConfig {self.name!r}: sequence parallelism shards activations across the "
                "tensor-parallel axis, so it needs tp > 1; set tp>=2 or sp=False"
            )
        if self.sp and self.cp > 1:
            raise ValueError(
                f"DistConfig {self.name!r}: sp and cp both shard the sequence, and hotswitch does not combine "
                "them yet; use cp with plain tp (e.g. 'tp2cp2'), or tp with sp and no cp"
            )
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"DistConfig {self.name!r}: fsdp must be True or False, got {self.fsdp!r}")
        if self.fsdp and self.dp == 1:
            raise ValueError(
                f"DistConfig {self.name!r}: fsdp shards the parameters over the data-parallel ranks, so it needs "
                "dp > 1; set dp>=2 (e.g. 'fsdp4' or 'dp=4,fsdp') or fsdp=False"
            )
        if self.fsdp and self.pp > 1:
            raise ValueError(
                f"DistConfig {self.name!r}: fsdp with pipeline parallelism is not supported (a stage's gradients "
                "are reduced after its last micro-batch, not per block); use fsdp with dp/tp/sp/cp only "
                "(e.g. 'fsdp2tp2'), or pp with plain dp ('dp2pp2')"
            )
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"DistConfig {self.name!r}: recompute must be one of {', '.join(RECOMPUTE)}, got "
                             f"{self.recompute!r}")
        if self.devices is not None:
            object.__setattr__(self, "devices", self._check_devices(self.devices))

    def _check_devices(self, devices: Sequence[int]) -> tuple[int, ...]:
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
            raise ValueError(f"DistConfig {self.name!r}: devices must be a list of ranks, got {devices!r}")
        if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in devices):
            raise ValueError(
                f"DistConfig {self.name!r}: devices must be non-negative int ranks, got {list(devices)}"
            )
        devices = tuple(int(d) for d in devices)
        if len(set(devices)) != len(devices):
            raise ValueError(
                f"DistConfig {self.name!r}: devices {list(devices)} repeat a rank; list each rank once"
            )
        if len(devices) != self.world_size:
            raise ValueError(
                f"DistConfig {self.name!r} needs {self._product} = {self.world_size} devices but {len(devices)} "
                f"were given; pass exactly {self.world_size} devices or change the degrees"
            )
        return devices

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def sequence_shards(self) -> int:
        """Into how many even parts a sequence is cut (tp under sp, cp): every length this config
        runs must be a multiple of it."""
        return (self.tp if self.sp else 1) * self.cp

    @property
    def _product(self) -> str:
        """How the device count is made, for messages: "dp*tp*pp" (with "cp" when it is used)."""
        return "dp*cp*tp*pp" if self.cp > 1 else "dp*tp*pp"

    @property
    def axis_names(self) -> tuple[str, ...]:
        return AXIS_NAMES

    def ranks(self) -> tuple[int, ...]:
        """The devices this config runs on, in mesh (row-major) order."""
        return self.devices if self.devices is not None else tuple(range(self.world_size))

    def mesh(self) -> Mesh:
        """Mesh of shape (pp, dp, cp, tp), tp innermost; every axis present even when its size is 1."""
        return Mesh.from_shape((self.pp, self.dp, self.cp, self.tp), AXIS_NAMES, self.ranks())

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """The axes a pipeline stage computes on: dp, cp and tp where above 1 (dp alone on one device).
        Axes of size 1 are left out so that sharding propagation searches no dead mesh dims."""
        return tuple(a for a in ("dp", "cp", "tp") if getattr(self, a) > 1) or ("dp",)

    @property
    def compute_axes(self) -> tuple[str, ...]:
        """The axes of `compute_mesh` / `device_mesh`: "pp" first when pp > 1, then `stage_axes`."""
        return (("pp",) if self.pp > 1 else ()) + self.stage_axes

    def compute_mesh(self, devices: Sequence[int] | None = None) -> Mesh:
        """The mesh the runtime computes on, as a pure value: `compute_axes`, over `devices` (default
        this config's ranks). Parameter layouts of pp = 1 configs live on it."""
        devices = self.ranks() if devices is None else self._check_devices(devices)
        return Mesh.from_shape(tuple(getattr(self, a) for a in self.compute_axes), self.compute_axes, devices)

    def device_mesh(self, device_type: str = "cpu"):
        """The torch DeviceMesh of `compute_mesh()` on the current process group: the one place the
        runtime's meshes are built (look axes up by name: `mesh["tp"]`, `mesh["dp", "tp"]`)."""
        from torch.distributed.device_mesh import DeviceMesh

        mesh = self.compute_mesh()
        return DeviceMesh(device_type, mesh.as_array().tolist(), mesh_dim_names=mesh.axis_names)

    def check_world_size(self, world_size: int) -> None:
        """Raise if this config cannot run in a job of `world_size` processes."""
        if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        n = self.world_size
        if self.devices is not None:
            outside = [d for d in self.devices if d >= world_size]
            if outside:
                raise ValueError(
                    f"DistConfig {self.name!r} uses devices {outside} but the job has {world_size} "
                    f"processes (ranks 0..{world_size - 1}); pass devices that are ranks of the job"
                )
            return
        if n == world_size:
            return
        fix = f"change the degrees so that {self._product} = {world_size}"
        if n < world_size:
            fix += f" or pass devices=[...] with {n} of the {world_size} ranks"
        raise ValueError(
            f"DistConfig {self.name!r} uses {self._product} = {n} devices but the job has {world_size} "
            f"processes; {fix}"
        )

    def instantiate(
        self, num_devices: int, devices: Sequence[int] | None = None, name: str | None = None
    ) -> DistConfig:
        """This config on `num_devices` devices (elastic change): tp, cp, pp and sp kept, dp scaled.

        The name is kept (it identifies the config across the change) unless `name` is given.
        """
        model_parallel = self.tp * self.pp * self.cp
        if not isinstance(num_devices, numbers.Integral) or num_devices < 1 or num_devices % model_parallel:
            raise ValueError(
                f"DistConfig {self.name!r} cannot run on {num_devices!r} devices: cp*tp*pp = {model_parallel} "
                f"must divide the device count; use a multiple of {model_parallel} devices or a config "
                "with smaller cp/tp/pp"
            )
        dp = int(num_devices) // model_parallel
        return replace(  # (fsdp over one replica is no sharding: that replica holds the parameters whole)
            self, name=self.name if name is None else name, dp=dp, fsdp=self.fsdp and dp > 1,
            devices=None if devices is None else tuple(devices),
        )

    @classmethod
    def parse(cls, spec: str | DistConfig) -> DistConfig:
        """The one config grammar, accepted everywhere a config is given as a string.

        Two spellings of the same config: the compact name "dp2tp4pp2sp" or "dp2tp2cp2" (axes in the
        order dp, tp, cp, pp; degrees of 1 may be left out; "sp" last) and key=value pairs
        "dp=2,tp=4,pp=2,sp" (keys name, dp, tp, cp, pp, sp, devices;
        a bare "sp" means sp=true; devices are ':'-separated ranks, "devices=0:1:2:3"). The name
        defaults to the compact form, so "dp2tp2sp" and "dp=2,tp=2,sp" give equal configs. A
        DistConfig is returned as it is.
        """
        if isinstance(spec, DistConfig):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"a DistConfig or a config string is needed, got {type(spec).__name__}: {spec!r}; "
                             f"{GRAMMAR}")
        compact = _COMPACT.fullmatch(spec.strip())
        if compact and spec.strip():  # (an empty string is key=value pairs with every default: one device)
            fsdp = bool(compact[1])
            dp, tp, cp, pp = (int(d or 1) for d in compact.groups()[1:5])
            sp, recompute = bool(compact[6]), _RECOMPUTE_SUFFIX.get(compact[7], "none")
            return cls(default_name(dp, tp, pp, sp, cp, fsdp, recompute), dp=dp, tp=tp, pp=pp, sp=sp, cp=cp,
                       fsdp=fsdp, recompute=recompute)
        fields: dict[str, object] = {}
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            key, sep, value = (s.strip() for s in item.partition("="))
            if key in ("sp", "fsdp") and not sep:
                value = "true"
            if not sep and item not in ("sp", "fsdp") and _COMPACT.fullmatch(item):
                raise ValueError(f"DistConfig spec {spec!r}: {item!r} is a whole config; one string is one config "
                                 f"(or use parse_configs for several); {GRAMMAR}")
            if key not in ("name", "dp", "tp", "cp", "pp", "sp", "fsdp", "recompute", "devices") or (
                    key not in ("sp", "fsdp") and not sep):
                raise ValueError(f"DistConfig spec {spec!r}: cannot read {item!r}; {GRAMMAR}")
            if key in fields:
                raise ValueError(f"DistConfig spec {spec!r} sets {key!r} twice; give each key once")
            fields[key] = _parse_value(spec, key, value)
        if "name" not in fields:
            degrees = (fields.get("dp", 1), fields.get("tp", 1), fields.get("pp", 1))
            fields["name"] = default_name(*degrees, sp=fields.get("sp", False), cp=fields.get("cp", 1),
                                          fsdp=fields.get("fsdp", False), recompute=fields.get("recompute", "none"))
        return cls(**fields)

    def spec(self) -> str:
        """The string `parse` reads back into this config."""
        text = f"name={self.name},dp={self.dp},tp={self.tp},pp={self.pp}" + (f",cp={self.cp}" if self.cp > 1 else "")
        text += ",sp" if self.sp else ""
        text += ",fsdp" if self.fsdp else ""
        text += f",recompute={self.recompute}" if self.recompute != "none" else ""
        if self.devices is not None:
            text += ",devices=" + ":".join(map(str, self.devices))
        return text

    def describe(self) -> str:
        """One line for logs, e.g. "long: dp=1 tp=4 pp=2 +sp on 8 devices"."""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        text = f"{self.name}: dp={self.dp}{cp} tp={self.tp} pp={self.pp}{' +sp' if self.sp else ''}"
        text += (" +fsdp" if self.fsdp else "") + (f" +recompute={self.recompute}" if self.recompute != "none" else "")
        text += f" on {self.world_size} device{'s' if self.world_size > 1 else ''}"
        return text + (f" {list(self.devices)}" if self.devices is not None else "")


def parse_configs(configs: str | DistConfig | Iterable[str | DistConfig]) -> list[DistConfig]:
    """The configs of a job as users give them, read by the one grammar (`DistConfig.parse`): a list
    of DistConfigs and config strings (["dp4", "dp=2,tp=2", DistConfig("long", tp=4, sp=True)]), or
    one string of several, as command lines take them, separated by ';' ("dp=4;tp=4,sp") or by ','
    between compact names ("dp4,dp2tp2,tp4sp"; "dp=2,tp=2,sp", with '=', stays one config). At
    least one config; names unique. `hs.compile`, the Trainer and every CLI command read configs here.
    """
    if isinstance(configs, DistConfig):
        configs = [configs]
    elif isinstance(configs, str):
        items = configs.split(";") if ";" in configs else configs.split(",")
        if ";" not in configs and any("=" in i for i in items):  # "dp=2,tp=2,sp": one config's key=value pairs
            items = [configs]
        configs = [i for i in items if i.strip()]
    elif not isinstance(configs, Iterable):
        raise ValueError(f"configs must be a list of DistConfigs or config strings, got {type(configs).__name__}: "
                         f"{configs!r}; {GRAMMAR}")
    configs = [DistConfig.parse(c) for c in configs]
    if not configs:
        raise ValueError(f"no configs given: pass at least one, e.g. ['dp4', 'tp4sp']; {GRAMMAR}")
    names = [c.name for c in configs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"configs {names} repeat the name(s) {repeated}: give each config once, or name the "
                         "variants apart (DistConfig(name=..., ...) or 'name=long,tp=4,sp')")
    return configs


def default_name(dp: int, tp: int, pp: int, sp: bool, cp: int = 1, fsdp: bool = False,
                 recompute: str = "none") -> str:
    """"dp2tp4" style: the degrees above 1 (dp, tp, cp, pp order; "fsdp" for a dp that shards the
    parameters), then "sp", then "-full" or "-sel" for recomputation; "dp1" for one device."""
    name = "".join(f"{'fsdp' if axis == 'dp' and fsdp else axis}{d}"
                   for axis, d in (("dp", dp), ("tp", tp), ("cp", cp), ("pp", pp)) if d != 1 or (axis == "dp" and fsdp))
    suffix = {v: k for k, v in _RECOMPUTE_SUFFIX.items()}.get(recompute)
    return (name or "dp1") + ("sp" if sp else "") + (f"-{suffix}" if suffix else "")


def _parse_value(spec: str, key: str, value: str):
    if key == "name":
        return value
    if key == "recompute":
        return value
    if key in ("sp", "fsdp"):
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ValueError(f"DistConfig spec {spec!r}: {key}={value!r} is not a boolean; write {key}, {key}=1 or {key}=0")
    try:
        if key == "devices":
            return tuple(int(d) for d in value.split(":"))
        return int(value)
    except ValueError:
        example = "devices=0:1:2:3" if key == "devices" else f"{key}=4"
        raise ValueError(
            f"DistConfig spec {spec!r}: {key}={value!r} is not a number; write e.g. {example}"
        ) from None


def standard_configs(world_size: int, *, pipeline: bool = False) -> list[DistConfig]:
    """The usual candidates on `world_size` devices, in this order: pure DP, DP x TP2, TP, TP + SP
    and, with `pipeline`, DP x TP2 x PP2 and DP x PP2 (each where the world size allows it). The
    demo, the training CLI and the benchmarks pick their defaults from this one list by name."""
    w = world_size
    if not isinstance(w, numbers.Integral) or w < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    out = [DistConfig.parse(f"dp{w}")]
    if w >= 4 and w % 2 == 0:
        out.append(DistConfig.parse(f"dp{w // 2}tp2"))
    if w > 1:
        out += [DistConfig.parse(f"tp{w}"), DistConfig.parse(f"tp{w}sp")]
    if pipeline and w % 4 == 0:
        out.append(DistConfig.parse(default_name(w // 4, 2, 2, False)))
    if pipeline and w % 2 == 0:
        out.append(DistConfig.parse(default_name(w // 2, 1, 2, False)))
    unique = {c.name: c for c in out}
    return list(unique.values())
