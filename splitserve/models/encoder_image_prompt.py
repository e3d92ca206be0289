"""The front's processor for encoder-decoder image models that take one image per request as the
encoder's whole input (Pix2Struct, Nougat): the decoder's prompt is the start token, the image is
the request's one `ImageItem` (offset 0, `num_tokens` = its encoder length). A model's processor
subclasses this with `encoder_item(img, img_hash, text)`; the text is what the user wrote (the
prompt, or a chat's user text parts), which each model uses or not.

The server calls `chat_prompt_from_messages` instead of rendering a chat template (these models
have none); `load_image_processor` reads the checkpoint's HF image processor.
"""
from __future__ import annotations


class EncoderImagePromptProcessor:
    model_name = "this model"

    def __init__(self, model, model_directory: str, tokenizer):
        from splitserve.multimodal.processor import load_image_processor
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = load_image_processor(model_directory)

    def set_preprocess_device(self, device) -> None:
        """Tensor-op preprocessing on `device` where the image processor has a tensor version."""
        from splitserve.multimodal.tensor_preprocess import tensor_processor_for
        fast = tensor_processor_for(self.image_processor, device)
        if fast is not None:
            self.image_processor = fast

    def encoder_item(self, img, img_hash: str, text: str):
        """The image's ImageItem (offset 0) for the encoder, given the request's text."""
        raise NotImplementedError

    # -- images -------------------------------------------------------------------------------------
    def process_image(self, img):
        """(content hash, the decoded image): the encoder input is cut in build_prompt, where the
        request's text is known."""
        from splitserve.protocol.mm_inputs import image_hash
        return image_hash(img), img

    def load_and_process(self, sources: list, policy):
        from splitserve.multimodal.media import load_image
        return [self.process_image(load_image(s, policy)) for s in sources]

    def check_count(self, n: int, policy) -> None:
        from splitserve.multimodal.media import MediaError
        if n != 1:
            raise MediaError(f"{self.model_name} takes exactly one image per request, got {n}")

    # -- prompts ------------------------------------------------------------------------------------
    def build_prompt(self, prompt, images):
        """A text prompt or token ids (ids equal to `placeholder_id` mark the image; the others are
        decoded as the text) and one processed image -> the decoder's start token with the image."""
        from splitserve.protocol.mm_inputs import MultiModalPrompt
        self.check_count(len(images), None)
        if not isinstance(prompt, str):
            prompt = self.tokenizer.decode([t for t in prompt if t != self.placeholder_id], skip_special_tokens=True)
        img_hash, img = images[0]
        return MultiModalPrompt([self.decoder_start_token_id], [self.encoder_item(img, img_hash, prompt.strip())])

    @staticmethod
    def split_chat(messages: list[dict]):
        from splitserve.multimodal.processor import MultiModalProcessor
        return MultiModalProcessor.split_chat(messages)

    def chat_prompt_from_messages(self, messages: list[dict], images):
        """Chat without a template: the text parts of the user's messages are the request's text."""
        from splitserve.multimodal.processor import IMAGE_MARKER
        converted, _ = self.split_chat(messages)
        text = "\n".join(m["content"] for m in converted if m.get("role") == "user")
        return self.build_prompt(text.replace(IMAGE_MARKER, " ").strip(), images)

    def chat_prompt(self, messages: list[dict], render_text, policy):
        _, sources = self.split_chat(messages)
        self.check_count(len(sources), policy)
        return self.chat_prompt_from_messages(messages, self.load_and_process(sources, policy))
