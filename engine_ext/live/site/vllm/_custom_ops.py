"""Never called: without AVX-512/AMX SGLang's rotary layer runs `forward_native` on CPU."""


def rotary_embedding(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("vllm rotary_embedding stand-in: SGLang should run forward_native on CPU")
