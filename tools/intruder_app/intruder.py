"""A foreign app's code on the server and on every device: each writes a file under ``mark-dir`` that says it ran."""

from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


def mark(context: Context, name: str, mark_dir: str) -> None:
    Path(mark_dir).mkdir(parents=True, exist_ok=True)
    (Path(mark_dir) / f"{name}-run-{context.run_id}").write_text("ran\n")


@server.main()
def main(grid: Grid, context: Context) -> None:
    mark_dir = str(context.run_config["mark-dir"])
    mark(context, "server", mark_dir)
    content = RecordDict({"config": ConfigRecord({"mark-dir": mark_dir})})
    messages = [Message(content, dst_node_id=node, message_type="query") for node in grid.get_node_ids()]
    replies = list(grid.send_and_receive(messages, timeout=120))
    print(f"intruder: {sum(r.has_content() for r in replies)} of {len(messages)} nodes ran its ClientApp")


@client.query()
def query(msg: Message, context: Context) -> Message:
    mark(context, f"node-{context.node_id}", str(msg.content["config"]["mark-dir"]))
    return Message(RecordDict(), reply_to=msg)
