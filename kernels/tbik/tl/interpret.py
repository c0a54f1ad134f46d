"""Four fixes that keep Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) usable for these kernels.

1. The interpreter holds every scalar as a one-element array and turns it into a Python int
   with int(array) wherever a loop bound needs one; NumPy 2.4 made that an error for arrays of
   one dimension, which breaks every kernel with a run-time loop bound.
2. The interpreter stores bfloat16 as raw uint16 and its tl.dot multiplies those integers.
   Operands are widened to fp32 (exact). And its dot is an np.matmul, i.e. BLAS, whose result
   for one row was seen to depend on where the row sits in the tile (so a kernel could never
   be batch-invariant there); the dot here sums the K products of a tile in index order,
   the same for every row and column, then adds the accumulator, as one MMA tile step does.
3. Its fp32 -> bf16 cast truncates; GPUs and torch round to nearest even, so it does too.
4. The CUDA math library's functions (libdevice) cannot run in it: exp, cos and sin become
   NumPy's while it is on (standard_library, with triton.language's own helpers).
backend.use_interpreter() applies them (nothing is patched otherwise); fixes 1-3 are applied once.
"""

def apply() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_tbik_patched", False):
        return
    interpreter._tbik_patched = True

    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        patch_lang_tensor = interpreter._patch_lang_tensor

        def patch_index(tensor, scope):
            patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

        interpreter._patch_lang_tensor = patch_index

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        if h.dtype.scalar == tl.float16:
            return interpreter.TensorHandle(h.data.astype(np.float32), tl.float32)
        return h

    def create_dot_ordered(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar.is_int() or d.dtype.scalar != tl.float32:
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        # C order: a transposed operand (b.T of a TMA load) would otherwise make K the innermost
        # axis of the products, and NumPy sums an innermost axis pairwise, not in order.
        a, b = (widen(x).data.astype(np.float32, order="C") for x in (a, b))
        products = a[..., :, :, None] * b[..., None, :, :]  # [.., M, K, N]
        # A reduction over a non-innermost axis adds the K slices one after the other.
        return interpreter.TensorHandle(products.sum(axis=-2, dtype=np.float32) + d.data, tl.float32)

    interpreter.InterpreterBuilder.create_dot = create_dot_ordered

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(src.data)
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # stay a (quiet) NaN
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    interpreter.InterpreterBuilder.cast_impl = cast_rne


_compiled: dict[str, object] = {}  # triton.language.standard's own @jit helpers, as triton made them


def standard_library(interpreted: bool) -> None:
    """triton.language's own @jit helpers (cdiv, sum, max, ...) are compiled or interpreted as
    triton was when first imported, and an interpreted kernel cannot call a compiled one: they
    are swapped for interpreted ones here (in triton.language too, which re-exports them), and
    back when the interpreter is turned off."""
    import triton.language as tl
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    _libdevice(interpreted)
    if interpreted:
        for name, value in list(vars(standard).items()):
            if isinstance(value, JITFunction):
                _compiled[name] = value
                swapped = InterpretedFunction(value.fn)
                setattr(standard, name, swapped)
                if getattr(tl, name, None) is value:
                    setattr(tl, name, swapped)
    else:
        for name, value in _compiled.items():
            if getattr(tl, name, None) is getattr(standard, name):
                setattr(tl, name, value)
            setattr(standard, name, value)
        _compiled.clear()


_LIBDEVICE = ("exp", "cos", "sin")
_libdevice_compiled: dict[str, object] = {}


def _libdevice(interpreted: bool) -> None:
    """The CUDA math library's exp, cos and sin (tl/elementwise.py calls them for torch's bits)
    have no interpreter implementation; interpreted, they are tl.exp, tl.cos and tl.sin (NumPy's),
    looked up at each call, after the interpreter has patched triton.language."""
    import triton.language as tl
    from triton.language.extra.cuda import libdevice

    if interpreted and not _libdevice_compiled:
        for name in _LIBDEVICE:
            _libdevice_compiled[name] = getattr(libdevice, name)
            setattr(libdevice, name, lambda x, _name=name, **_: getattr(tl, _name)(x))
    elif not interpreted:
        for name, fn in _libdevice_compiled.items():
            setattr(libdevice, name, fn)
        _libdevice_compiled.clear()
