"""Plug-in files the tests write and load, as a researcher's ``--plugin FILE``."""

#: a method with persistent client state: a pull towards the client's own moving average of its models
EMA_PLUGIN = '''
from hetfl.algorithms import register
from hetfl.algorithms.base import Algorithm, cross_entropy

EMA = "ema/"


@register
class EmaProx(Algorithm):
    """A pull towards the client's own moving average of its models, kept in its persistent state."""

    name = "emaprox_test"
    citation = "a test"

    def init_client_state(self, client_id, server):
        return {EMA + n: server.model[n].clone() for n in self.model.param_names}

    def loss(self, state, batch, ctx):
        ce = cross_entropy(self.model.logits(state, batch.x), batch.y)
        prox = sum((state[n] - ctx.state[EMA + n]).pow(2).sum() for n in self.model.param_names)
        return ce + 0.05 * prox, {"ce": ce.detach(), "prox": prox.detach()}

    def finish(self, ctx, local, steps):
        upload = {n: local[n] for n in self.model.state_names}
        return upload, {EMA + n: 0.5 * ctx.state[EMA + n] + 0.5 * local[n] for n in self.model.param_names}
'''
