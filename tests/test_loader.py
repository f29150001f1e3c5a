"""Loader: argument packing, error messages, arch detection (CPU only)."""

import ctypes
import struct

import pytest
import torch

import cute_attn
from cute_attn.abi import args as abi_args
from cute_attn.families.spec import Spec
from cute_attn.runtime import arch, build, loader
from cute_attn.runtime import header as abi


def test_import_needs_no_gpu_or_dsl():
    assert callable(cute_attn.merge_states) and cute_attn.__version__


@pytest.mark.parametrize("nshape,nstride", [(0, 0), (1, 0), (1, 1), (2, 2), (3, 3), (4, 0), (0, 2)])
def test_struct_format_matches_c_layout(nshape, nstride):
    """Our packed layout must equal the C struct the DSL header declares."""
    fields = [("data", ctypes.c_void_p)]
    if nshape:
        fields.append(("shapes", ctypes.c_int32 * nshape))
    if nstride:
        fields.append(("strides", ctypes.c_int64 * nstride))
    C = type("C", (ctypes.Structure,), {"_fields_": fields})
    arg = abi_args.TensorArg(
        "t",
        "f32",
        (None,) * nshape + (4,) * (4 - nshape) if nshape < 4 else (None,) * 4,
        (None,) * nstride + (1,) * (4 - nstride) if nstride < 4 else (None,) * 4,
    )
    fmt = "=" + abi.struct_format(arg)
    assert struct.calcsize(fmt) == ctypes.sizeof(C)
    vals = [0x1234] + list(range(1, nshape + 1)) + list(range(100, 100 + nstride))
    c = C.from_buffer_copy(struct.pack(fmt, *vals))
    assert c.data == 0x1234
    if nshape:
        assert list(c.shapes) == vals[1 : 1 + nshape]
    if nstride:
        assert list(c.strides) == vals[1 + nshape :]


def test_parse_header_sample():
    text = """
typedef struct {
    void *data;
    int32_t dynamic_shapes[2];
    int64_t dynamic_strides[1];
} p_Tensor_mA_t;
typedef struct {
    void *data;
} p_Tensor_mB_t;
void _mlir_p_cuda_init(void **);
void _mlir_p_cuda_load_to_device(void **);
static inline int32_t cute_dsl_p_wrapper(p_Kernel_Module_t *module, p_Tensor_mA_t *mA, p_Tensor_mB_t *mB, cudaStream_t stream) {
    int32_t ret = 0;
    void *args[4] = {
        mA, mB, &stream,
        &ret
    };
    _mlir_p__mlir_ciface_fn(args, 4);
    return ret;
}
"""
    h = abi.parse_header(text)
    assert (h.init_symbol, h.load_symbol, h.launch_symbol, h.num_args) == (
        "_mlir_p_cuda_init",
        "_mlir_p_cuda_load_to_device",
        "_mlir_p__mlir_ciface_fn",
        4,
    )
    assert h.tensor_structs == (("p_Tensor_mA", 2, 1), ("p_Tensor_mB", 0, 0))
    args = [abi_args.TensorArg("mA", "f32", (None, None, 8), (None, 8, 1)), abi_args.TensorArg("mB", "f32", (4,), (1,))]
    abi.check_header(h, args, "p")
    with pytest.raises(RuntimeError, match="dynamic"):
        abi.check_header(h, [args[0], abi_args.TensorArg("mB", "f32", (None,), (1,))], "p")
    with pytest.raises(RuntimeError):
        abi.parse_header("not a header")


def test_tensor_fields_checks():
    a = abi_args.TensorArg("mV", "bf16", (None, None, 128), (None, None, 1), stride_divisibility=8, align=16)
    t = torch.empty(3, 5, 128, dtype=torch.bfloat16)
    f = loader.tensor_fields(a, t)
    assert f[1:] == [3, 5, 5 * 128, 128]
    with pytest.raises(loader.LaunchError, match="dim 2 must be 128"):
        loader.tensor_fields(a, torch.empty(3, 5, 64, dtype=torch.bfloat16))
    with pytest.raises(loader.LaunchError, match="stride"):
        loader.tensor_fields(a, torch.empty(3, 128, 5, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(loader.LaunchError, match="multiple of 8"):
        loader.tensor_fields(a, torch.empty(3, 5, 132, dtype=torch.bfloat16)[:, :, :128])
    with pytest.raises(loader.LaunchError, match="aligned"):
        loader.tensor_fields(a, torch.empty(3 * 5 * 128 + 1, dtype=torch.bfloat16)[1:].view(3, 5, 128))
    with pytest.raises(loader.LaunchError, match="3 dims"):
        loader.tensor_fields(a, torch.empty(5, 128, dtype=torch.bfloat16))


def test_missing_kernel_without_dsl_names_spec_and_command(tmp_cache, monkeypatch):
    monkeypatch.setattr(build, "dsl_available", lambda: False)
    spec = Spec.make("merge_states", "sm_90a", dtype="bf16", head_dim=96)
    with pytest.raises(loader.KernelNotAvailable) as e:
        loader.get_module(spec)
    msg = str(e.value)
    assert "merge_states[dtype=bf16,head_dim=96]@sm_90a" in msg
    assert "python -m cute_attn compile --arch sm_90a --spec 'merge_states:dtype=bf16,head_dim=96'" in msg
    assert str(tmp_cache) in msg


def test_build_without_dsl_is_a_clear_error(tmp_cache, monkeypatch):
    monkeypatch.setattr(build, "installed_dsl_version", lambda: None)
    with pytest.raises(build.BuildError, match="nvidia-cutlass-dsl is not installed"):
        build.build(Spec.make("merge_states", "sm_90a", dtype="bf16", head_dim=128))


@pytest.mark.parametrize(
    "cap,expect", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 0), None), ((9, 1), None), ((12, 0), None)]
)
def test_arch_detection(monkeypatch, cap, expect):
    arch.arch_of_index.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Fake GPU")
    try:
        if expect:
            assert arch.device_arch(torch.device("cuda", 0)) == expect
        else:
            with pytest.raises(RuntimeError, match=f"sm_{cap[0]}{cap[1]}"):
                arch.device_arch(torch.device("cuda", 0))
    finally:
        arch.arch_of_index.cache_clear()


def test_cpu_tensor_is_rejected():
    with pytest.raises(ValueError, match="CUDA tensors"):
        arch.device_arch(torch.device("cpu"))


def test_merge_validation_errors_on_cpu():
    v = torch.randn(4, 3, 2, 128, dtype=torch.bfloat16)
    s = torch.randn(4, 3, 2)
    with pytest.raises(ValueError, match="CUDA tensors"):
        cute_attn.merge_states(v, s)
    with pytest.raises(TypeError, match="float32"):
        cute_attn.merge_states(v, s.double())
    with pytest.raises(ValueError, match="shape"):
        cute_attn.merge_states(v, s[:, :2])
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        cute_attn.merge_states(v.to(torch.int8), s)
    with pytest.raises(ValueError, match="multiple of 8"):
        cute_attn.merge_states(v[..., :100], s)
    with pytest.raises(ValueError, match="must match"):
        cute_attn.merge_state(v[:, 0], s[:, 0], v[:, 0].half(), s[:, 0])
