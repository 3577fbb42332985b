"""kubetrain/trainer/preload.py: the optimizer without torch._dynamo's import, its step too, and the import in a thread before a fork."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_an_optimizer_is_built_saved_and_restored_without_importing_dynamo():
    assert run("""
        import sys, torch
        from kubetrain.trainer.preload import without_dynamo_import
        without_dynamo_import()
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(3, 4)).sum().backward()
        before = "torch._dynamo" in sys.modules
        optimizer.step()  # the step itself imports it (a graph break for torch.compile), as torch does
        optimizer.load_state_dict(optimizer.state_dict())
        optimizer.zero_grad()
        print(before, optimizer.state_dict()["state"][0]["momentum_buffer"].shape == (2, 4))
    """) == "False True"


def test_with_dynamo_loaded_already_the_wrappers_are_left_alone():
    assert run("""
        import torch, torch._dynamo  # a plug-in that compiles loaded it first
        from kubetrain.trainer.preload import without_dynamo_import
        without_dynamo_import()
        torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1).zero_grad()
        inner = torch.optim.Optimizer.zero_grad.__wrapped__
        print(inner.__dynamo_disable is not inner)
    """) == "True"


def test_a_fork_waits_for_the_preload_and_the_child_has_it():
    assert run("""
        import os, sys
        from kubetrain.trainer.preload import preload
        assert "torch._dynamo" not in sys.modules
        thread = preload(before_fork=True)
        pid = os.fork()  # at once: the fork must wait for the import, never copy it half done
        if pid == 0:
            os._exit(0 if "torch._dynamo" in sys.modules else 1)
        _, status = os.waitpid(pid, 0)
        print(thread.is_alive(), os.waitstatus_to_exitcode(status))
    """) == "False 0"


def test_optimizer_step_without_dynamo_makes_the_same_update_as_torchs_step():
    assert run("""
        import sys, torch
        from kubetrain.trainer.preload import optimizer_step, without_dynamo_import
        without_dynamo_import()

        def trained(kind, step):
            torch.manual_seed(0)
            model = torch.nn.Linear(8, 3)
            optimizer = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
                         "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)}[kind](model.parameters())
            for i in range(5):
                optimizer.zero_grad()
                model(torch.full((4, 8), float(i + 1))).pow(2).sum().backward()
                step(optimizer)
            return [p.detach().clone() for p in model.parameters()], optimizer.state_dict()["state"]

        mine = {kind: trained(kind, optimizer_step) for kind in ("sgd", "adam")}
        assert "torch._dynamo" not in sys.modules
        same = []
        for kind, (params, state) in mine.items():
            theirs, their_state = trained(kind, lambda o: o.step())
            same.append(all(torch.equal(a, b) for a, b in zip(params, theirs))
                        and all(torch.equal(state[i][k], their_state[i][k]) for i in state for k in state[i]))
        print(same, "torch._dynamo" in sys.modules)  # torch's own step imported it
    """) == "[True, True] True"


def test_optimizer_step_is_torchs_own_with_a_hook_or_with_dynamo_being_imported():
    assert run("""
        import sys, types, torch
        from kubetrain.trainer.preload import loaded, optimizer_step
        optimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
        calls = []
        handle = optimizer.register_step_post_hook(lambda *args: calls.append(1))
        optimizer_step(optimizer)  # a hook: torch's step runs it, and imports torch._dynamo
        hooked = (calls, "torch._dynamo" in sys.modules)
        fake = types.ModuleType("kt_half_imported")
        fake.__spec__ = types.SimpleNamespace(_initializing=True)
        sys.modules["kt_half_imported"] = fake  # another thread's import under way: importing it would wait
        half = loaded("kt_half_imported")
        fake.__spec__._initializing = False
        print(hooked, half, loaded("kt_half_imported"), loaded("no_such_module_here"))
    """) == "([1], True) False True False"
