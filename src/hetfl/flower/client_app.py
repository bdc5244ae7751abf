"""hetfl's Flower ClientApp: one app for every hetfl method (``hetfl.flower.client_app:app``).

Importing this module is light (Flower and the standard library): torch and hetfl's engine are
loaded by the first message that needs them, so a node answers ``query.hello`` quickly.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from hetfl.flower import node, offline_defaults
from hetfl.flower.secagg import secure_aggregation_mod

offline_defaults()
app = ClientApp()


@app.query("hello")
def hello(message: Message, context: Context) -> Message:
    return node.handle_hello(message, context)


@app.query("setup")
def setup(message: Message, context: Context) -> Message:
    return node.handle_setup(message, context)


@app.train(mods=[secure_aggregation_mod])  # SecAgg+'s messages to Flower's mod; hetfl's own straight through
def train(message: Message, context: Context) -> Message:
    return node.handle_train(message, context)


@app.query("posthoc")
def posthoc(message: Message, context: Context) -> Message:
    return node.handle_posthoc(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    return node.handle_evaluate(message, context)
