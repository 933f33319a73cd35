"""The MCP conformance suite's server scenarios, as a FastMCP server over HTTP.

``scripts/mcp-conformance`` runs the official suite against it three ways: bare,
with ``--governed`` (a ``BudgetMiddleware`` with a generous policy in the same
process) and behind ``mcpbg proxy``. The tool, resource and prompt names and the
texts are the ones the suite's scenarios ask for.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
from typing import Any

from fastmcp import Context, FastMCP
from fastmcp.prompts import Message
from fastmcp.tools import ToolResult
from mcp import types

# A 1x1 PNG and a 44-byte silent WAV: the smallest valid media the scenarios accept.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0g"
    "AAAABJRU5ErkJggg=="
)
WAV = base64.b64encode(
    b"RIFF$\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00@\x1f\x00\x00"
    b"\x80>\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00"
).decode()

mcp = FastMCP("mcpbg-conformance-upstream")


@mcp.tool
def test_simple_text() -> str:
    """Answers a fixed text."""
    return "This is a simple text response for testing."


@mcp.tool
def test_image_content() -> ToolResult:
    """Answers a 1x1 PNG."""
    return ToolResult(content=[types.ImageContent(type="image", data=PNG, mimeType="image/png")])


@mcp.tool
def test_audio_content() -> ToolResult:
    """Answers a short WAV."""
    return ToolResult(content=[types.AudioContent(type="audio", data=WAV, mimeType="audio/wav")])


def _resource(uri: str, mime: str, text: str) -> types.EmbeddedResource:
    contents = types.TextResourceContents(uri=uri, mimeType=mime, text=text)  # type: ignore[arg-type]
    return types.EmbeddedResource(type="resource", resource=contents)


@mcp.tool
def test_embedded_resource() -> ToolResult:
    """Answers an embedded text resource."""
    text = "This is an embedded resource content."
    return ToolResult(content=[_resource("test://embedded-resource", "text/plain", text)])


@mcp.tool
def test_multiple_content_types() -> ToolResult:
    """Answers text, an image and a resource."""
    data = json.dumps({"test": "data", "value": 123})
    return ToolResult(
        content=[
            types.TextContent(type="text", text="Multiple content types test:"),
            types.ImageContent(type="image", data=PNG, mimeType="image/png"),
            _resource("test://mixed-content-resource", "application/json", data),
        ]
    )


@mcp.tool
async def test_tool_with_logging(ctx: Context) -> str:
    """Logs three messages while it runs."""
    await ctx.info("Tool execution started")
    await asyncio.sleep(0.05)
    await ctx.info("Tool processing data")
    await asyncio.sleep(0.05)
    await ctx.info("Tool execution completed")
    return "Tool with logging executed successfully"


@mcp.tool
async def test_tool_with_progress(ctx: Context) -> str:
    """Reports progress 0, 50 and 100 of 100."""
    for step in (0, 50, 100):
        await ctx.report_progress(step, 100)
        if step < 100:
            await asyncio.sleep(0.05)
    return "Tool with progress executed successfully"


@mcp.tool
def test_error_handling() -> str:
    """Always fails."""
    raise ValueError("This tool intentionally returns an error for testing")


@mcp.tool
async def test_sampling(prompt: str, ctx: Context) -> str:
    """Asks the client's model."""
    message = types.SamplingMessage(
        role="user", content=types.TextContent(type="text", text=prompt)
    )
    r = await ctx.session.create_message(
        [message], max_tokens=100, related_request_id=ctx.request_id
    )
    text = r.content.text if isinstance(r.content, types.TextContent) else str(r.content)
    return f"LLM response: {text}"


async def _elicit(ctx: Context, message: str, schema: dict[str, Any]) -> types.ElicitResult:
    return await ctx.session.elicit_form(message, schema, related_request_id=ctx.request_id)


@mcp.tool
async def test_elicitation(message: str, ctx: Context) -> str:
    """Asks the user for a name and an email."""
    schema = {
        "type": "object",
        "properties": {
            "username": {"type": "string", "description": "User's response"},
            "email": {"type": "string", "description": "User's email address"},
        },
        "required": ["username", "email"],
    }
    r = await _elicit(ctx, message, schema)
    return f"User response: action={r.action}, content={json.dumps(r.content)}"


@mcp.tool
async def test_elicitation_sep1034_defaults(ctx: Context) -> str:
    """Asks with a default for every primitive type."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "default": "John Doe"},
            "age": {"type": "integer", "default": 30},
            "score": {"type": "number", "default": 95.5},
            "status": {
                "type": "string",
                "enum": ["active", "inactive", "pending"],
                "default": "active",
            },
            "verified": {"type": "boolean", "default": True},
        },
    }
    r = await _elicit(ctx, "Please review and update the form fields with defaults", schema)
    return f"Elicitation completed: action={r.action}, content={json.dumps(r.content)}"


@mcp.tool
async def test_elicitation_sep1330_enums(ctx: Context) -> str:
    """Asks with the five enum shapes."""
    options = ["option1", "option2", "option3"]
    schema = {
        "type": "object",
        "properties": {
            "untitledSingle": {"type": "string", "enum": options},
            "titledSingle": {
                "type": "string",
                "oneOf": [
                    {"const": "value1", "title": "First Option"},
                    {"const": "value2", "title": "Second Option"},
                    {"const": "value3", "title": "Third Option"},
                ],
            },
            "legacyEnum": {
                "type": "string",
                "enum": ["opt1", "opt2", "opt3"],
                "enumNames": ["Option One", "Option Two", "Option Three"],
            },
            "untitledMulti": {"type": "array", "items": {"type": "string", "enum": options}},
            "titledMulti": {
                "type": "array",
                "items": {
                    "anyOf": [
                        {"const": "value1", "title": "First Choice"},
                        {"const": "value2", "title": "Second Choice"},
                        {"const": "value3", "title": "Third Choice"},
                    ]
                },
            },
        },
    }
    r = await _elicit(ctx, "Please select options from the enum fields", schema)
    return f"Elicitation completed: action={r.action}, content={json.dumps(r.content)}"


@mcp.resource("test://static-text", mime_type="text/plain", description="A static text")
def static_text() -> str:
    return "This is the content of the static text resource."


@mcp.resource("test://static-binary", mime_type="image/png", description="A static PNG")
def static_binary() -> bytes:
    return base64.b64decode(PNG)


@mcp.resource("test://watched-resource", mime_type="text/plain", description="A watched text")
def watched() -> str:
    return "Watched resource content."


@mcp.resource("test://template/{id}/data", mime_type="application/json", description="By id")
def template(id: str) -> str:
    return json.dumps({"id": id, "templateTest": True, "data": f"Data for ID: {id}"})


@mcp.prompt
def test_simple_prompt() -> str:
    """A prompt without arguments."""
    return "This is a simple prompt for testing."


@mcp.prompt
def test_prompt_with_arguments(arg1: str, arg2: str) -> str:
    """A prompt with two arguments."""
    return f"Prompt with arguments: arg1='{arg1}', arg2='{arg2}'"


@mcp.prompt
def test_prompt_with_embedded_resource(
    resourceUri: str,
) -> list[Message]:  # the suite's argument name
    """A prompt embedding a resource."""
    text = "Embedded resource content for testing."
    return [
        Message(_resource(resourceUri, "text/plain", text)),
        Message("Please process the embedded resource above."),
    ]


@mcp.prompt
def test_prompt_with_image() -> list[Message]:
    """A prompt with an image."""
    image = types.ImageContent(type="image", data=PNG, mimeType="image/png")
    return [Message(image), Message("Please analyze the image above.")]


def _govern() -> None:
    """A BudgetMiddleware with caps no conformance run reaches (the suite's client is one user)."""
    from mcp_budget_governor import Context as Caller
    from mcp_budget_governor import Governor, Limit, MemoryBackend, Policy, Scope, Window
    from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware

    policy = Policy.of(Limit("calls", cap=1_000_000, window=Window.DAY, scope=Scope.USER))
    governor = Governor(policy, MemoryBackend())
    mcp.add_middleware(BudgetMiddleware(governor, identify=lambda c: Caller(user="conformance")))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--governed", action="store_true", help="add a generous BudgetMiddleware")
    args = p.parse_args()
    if args.governed:
        _govern()
    mcp.run(transport="http", host="127.0.0.1", port=args.port, show_banner=False)


if __name__ == "__main__":
    main()
