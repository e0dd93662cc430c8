"""Our vLLM KV connector. vLLM loads it by module path:

    KVTransferConfig(kv_connector="MooncakeConnector",
                     kv_connector_module_path="mooncake.connector.connector", kv_role="kv_both")
"""
