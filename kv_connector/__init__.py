"""Our vLLM KV connector: the one place where prefill's producer half and decode's consumer half
are composed into the class vLLM loads by module path (every engine runs both, as kv_both):

    KVTransferConfig(kv_connector="MooncakeServeConnector",
                     kv_connector_module_path="kv_connector.connector", kv_role="kv_both")

Named so that it never clashes with vLLM's built-in `MooncakeConnector`.
"""
