"""STAND-IN for apex.amp (tests only; see tests/standin/README.md). The signatures follow
apex/amp/frontend.py and apex/amp/handle.py; the behaviour is the least that keeps training
correct in fp32: a constant loss scale that is applied and removed again."""
import contextlib

import torch

from apex import _log

_state = {"initialized": False, "opt_level": None, "loss_scale": 2.0 ** 4, "unskipped": 0,
          "scaled_grads": False}


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
               min_loss_scale=None, max_loss_scale=2.**24):
    if _state["initialized"]:
        raise RuntimeError("stand-in: amp.initialize called twice (apex allows it once)")
    if isinstance(models, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError("stand-in: amp.initialize after the DDP wrap (apex refuses it)")
    _state.update(initialized=True, opt_level=opt_level)
    plain_zero_grad = optimizers.zero_grad

    def zero_grad():  # apex's replacement (apex/amp/_process_optimizer.py) takes no arguments
        plain_zero_grad()
    optimizers.zero_grad = zero_grad
    _log("amp.initialize", opt_level=opt_level,
         optimizer_steps=sum(len(s) for s in optimizers.state.values()))
    return models, optimizers


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    if not _state["initialized"]:
        raise RuntimeError("stand-in: scale_loss before amp.initialize")
    params = [p for g in optimizers.param_groups for p in g["params"]]
    # Like apex (amp/handle.py, amp/_process_optimizer.py): unless the last call delayed its
    # unscale, the gradients so far are moved aside and .grad is cleared before the backward;
    # on leaving, .grad = those + the new ones unscaled. With delay_unscale=True the new ones
    # stay scaled in .grad, added to, for a later call to unscale.
    stash = {} if _state["scaled_grads"] else {p: p.grad for p in params}
    for p in stash:
        p.grad = None
    before = [(p.grad, None if p.grad is None else p.grad._version) for p in params]
    scale = _state["loss_scale"]
    yield loss.float() * scale
    backward_inside = any(p.grad is not None and (p.grad is not g or p.grad._version != v)
                          for p, (g, v) in zip(params, before))
    if delay_unscale:
        _state["scaled_grads"] = True
    else:
        for p in params:
            if p.grad is not None:
                p.grad.div_(scale)
            if stash.get(p) is not None:
                p.grad = stash[p] if p.grad is None else p.grad.add_(stash[p])
        _state["scaled_grads"] = False
        _state["unskipped"] += 1
    _log("amp.scale_loss", backward_inside=backward_inside, delay_unscale=delay_unscale)


def state_dict(destination=None):
    return {"loss_scaler0": {"loss_scale": _state["loss_scale"],
                             "unskipped": _state["unskipped"]}}


def load_state_dict(state_dict):
    if not _state["initialized"]:
        raise RuntimeError("stand-in: amp.load_state_dict before amp.initialize")
    _state.update(loss_scale=state_dict["loss_scaler0"]["loss_scale"],
                  unskipped=state_dict["loss_scaler0"]["unskipped"])
    _log("amp.load_state_dict", state=state_dict)
