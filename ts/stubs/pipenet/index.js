// See package.json: nothing here opens an mcp-proxy tunnel.
throw new Error("pipenet is a stand-in here (ts/stubs/pipenet): the mcp-proxy tunnel is unused");
