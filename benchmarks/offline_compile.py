"""Compile Triton kernels for an NVIDIA GPU that this machine does not have (used by gpu_check.py --compile-only).

Triton compiles a kernel at its first launch, for the launch's own specialization (argument types, divisibility by
16, constexprs). With a stand-in driver that names the target and a JIT cache hook that compiles that
specialization and then skips the launch, every public launcher can be called as usual on CPU tensors: the kernels
are compiled exactly as a GPU run would compile them, and nothing runs (outputs stay uninitialized).
"""
import re
import subprocess
import tempfile
from pathlib import Path


def offline_compiler(arch):
    """From now on every Triton launch compiles for compute capability `arch` (e.g. 90) and does not run. Returns
    the list each compile is appended to: kernel, num_warps / num_stages, ok or error, shared memory, registers and
    stack (spills) from cuobjdump."""
    records = []
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.driver import driver

    class OfflineDriver:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 64 if arch >= 90 else 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        record = {"kernel": fn.name, "num_warps": compile["num_warps"], "num_stages": compile["num_stages"]}
        try:
            src = ASTSource(fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0])
            kernel = triton.compile(src, target=driver.active.get_current_target(),
                                    options={"num_warps": compile["num_warps"], "num_stages": compile["num_stages"]})
            record.update(ok=True, shared_bytes=kernel.metadata.shared)
            if cuobjdump.exists():
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(kernel.asm["cubin"])
                    f.flush()
                    usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                           text=True).stdout
                found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
                if found:
                    record.update(registers=int(found[1]), stack_bytes=int(found[2]))
        except Exception as e:                                  # noqa: BLE001
            record.update(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
        records.append(record)
        return True

    driver.set_active(OfflineDriver())
    triton.knobs.runtime.jit_cache_hook = hook
    return records
